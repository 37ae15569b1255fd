"""The ``fsdp`` TrainEngine, driver side: validates input, plans the step, commands the ranks.

The engine object lives in the caller's process (the flow runtime's event
loop). ``setup()`` starts ``world_size`` ranks (:mod:`asyncflow_fsdp.worker`)
with the process's rank spawner (:mod:`asyncflow_core.launchers.ranks`): child
processes by default, one Ray actor each under the ``ray`` launcher. Every
later call validates its input here, splits the rows over the ranks
(token-balanced) and into micro-batches, sends each rank its share, and waits
for all of them off the event loop. Results come back with the replies;
exported weight buckets through shared memory (so the ranks share this host).
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from pathlib import Path
from typing import Any

from asyncflow_core import columns as C
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Algorithm, TrainEngine, TrainFeatures
from asyncflow_core.launchers.packing import StepPlan, plan_step
from asyncflow_core.launchers.rank_driver import RankEngineDriver, reassemble, select_rows
from asyncflow_core.launchers.ranks import (
    RankGroup,
    RankHandle,
    driver_cpu_threads,
    gpus_for_ranks,
    rank_cpu_threads,
    start_rank_group,
)
from asyncflow_core.types import Batch
from asyncflow_fsdp.config import FSDPTrainConfig

log = logging.getLogger("asyncflow.fsdp")

#: imported by the forkserver once, so that forking a rank costs milliseconds instead of a torch import
FORKSERVER_PRELOAD = ("asyncflow_fsdp.worker",)


def _modeling_module(model: ModelConfig) -> list[str]:
    """The transformers module of the model's architecture (preloaded too: importing it takes seconds)."""
    model_type = None
    if model.hf_config is not None:
        model_type = model.hf_config.get("model_type")
    elif model.path is not None:
        try:
            model_type = json.loads((Path(model.path) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
    if not isinstance(model_type, str) or not model_type.replace("_", "").replace("-", "").isalnum():
        return []
    name = model_type.replace("-", "_")
    return [f"transformers.models.{name}.modeling_{name}"]


class FSDPTrainEngine(RankEngineDriver, TrainEngine):
    """A Hugging Face causal LM sharded with FSDP2 over ``world_size`` spawned ranks.

    Methods are called one at a time (the runtime serialises them); a call
    made while another is running raises :class:`EngineError`.
    """

    engine_name = "fsdp"

    def __init__(self, config: FSDPTrainConfig) -> None:
        self.config = config
        self._features = config.features()
        self._group: RankHandle | None = None
        self._version = 0
        self._busy: str | None = None
        self._info: dict[str, Any] = {}
        self._rank_devices: list[str] = []
        self._device_type = "cpu"
        self._finalizer: weakref.finalize | None = None
        #: (torch threads before setup, what setup set) when setup lowered this process's threads (_share_cpu)
        self._threads_before: tuple[int, int] | None = None

    # -- properties -------------------------------------------------------------

    @property
    def features(self) -> TrainFeatures:
        return self._features

    @property
    def version(self) -> int:
        return self._version

    @property
    def info(self) -> dict[str, Any]:
        """What rank 0 reported at setup: device, backend, vocab size, parameter count, architecture."""
        return dict(self._info)

    @property
    def rank_devices(self) -> list[str]:
        """The device each rank reported at setup, by rank (``cuda:r`` on a host whose GPUs every rank sees)."""
        return list(self._rank_devices)

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the ranks (empty before setup and after shutdown)."""
        return self._group.pids if self._group is not None else []

    # -- lifecycle --------------------------------------------------------------

    async def setup(self) -> None:
        if self._group is not None:
            raise EngineError("setup() was already called on this fsdp engine")
        c = self.config
        if c.model is None or (c.model.path is None and c.model.hf_config is None):
            raise EngineError("the fsdp engine has no model: set model.path (a local Hugging Face checkpoint) or "
                              "model.hf_config (an architecture to build) in the run's `model` section or the "
                              "engine's `model` option")
        self._device_type = self._resolve_device()
        await self._run("setup", self._start)
        self._share_cpu()

    def _share_cpu(self) -> None:
        """CPU ranks started as child processes of this one take ``cpu_threads_per_rank`` threads each (default:
        the cores over ``world_size + 1``, a share left to this process, where a rollout engine generates while
        they train); this process then keeps to what is left, so the two do not oversubscribe the cores (torch's
        threads on a shared core spin and wait on each other). Only ever lowers torch's intra-op threads, on the
        calling (event-loop) thread, which a ``torch`` rollout engine started later adopts unless its
        ``torch_threads`` says otherwise; :meth:`shutdown` restores them."""
        c = self.config
        if self._device_type != "cpu" or not isinstance(self._group, RankGroup):
            return  # GPU ranks, or ranks elsewhere (ray actors): nothing of this host's cores to share
        import torch

        share = driver_cpu_threads(c.world_size, rank_cpu_threads(c.world_size, 1, c.cpu_threads_per_rank))
        have = torch.get_num_threads()
        if have > share:
            torch.set_num_threads(share)
            self._threads_before = (have, share)
            log.info("this process computes with %d torch threads (was %d): the %d CPU rank(s) take the other cores",
                     share, have, c.world_size)

    def _resolve_device(self) -> str:
        c = self.config
        have = gpus_for_ranks(c.world_size)  # where the ranks will run: this host's GPUs, or their actors'
        if c.device == "cuda" and have < c.world_size:
            raise EngineError(f"device=cuda with world_size={c.world_size} needs {c.world_size} visible GPUs, "
                              f"found {have}; lower world_size or use device=cpu")
        if c.device == "auto":
            return "cuda" if have >= c.world_size else "cpu"
        return c.device

    def _start(self) -> None:
        from asyncflow_fsdp.worker import rank_main

        c = self.config
        group = start_rank_group(c.world_size, rank_main, (c.model_dump(mode="json"),), start_method=c.start_method,
                                 preload=(*FORKSERVER_PRELOAD, *_modeling_module(c.model)), name="asyncflow-fsdp-rank")
        self._group = group
        # an engine dropped without shutdown() still ends its ranks (daemonic ranks and rank actors also end with
        # this process)
        self._finalizer = weakref.finalize(self, group.stop, grace_s=0)
        port = group.call("bind", timeout_s=c.setup_timeout_s, what="setup (rendezvous)")[0]
        infos = group.call("setup", same={"port": port, "device": self._device_type}, timeout_s=c.setup_timeout_s,
                           what="setup")
        self._info = infos[0]
        self._rank_devices = [str(info["device"]) for info in infos]

    async def shutdown(self) -> None:
        group, self._group = self._group, None
        threads, self._threads_before = self._threads_before, None
        if threads is not None:
            import torch

            if torch.get_num_threads() == threads[1]:  # nobody changed them since: give the cores back
                torch.set_num_threads(threads[0])
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if group is not None:
            await asyncio.to_thread(group.stop)

    # -- forward ----------------------------------------------------------------

    async def compute_logprobs(self, batch: Batch, *, values: bool = False) -> Batch:
        group = self._ready()
        if values and not self._features.supports_values:
            raise UnsupportedFeatureError("this fsdp engine has no value head: set the option value_head: true "
                                          "(supports_values follows it)")
        self._validate(batch, (C.PROMPT_IDS, C.RESPONSE_IDS))
        plan = self._plan(batch)
        payloads = [{"batch": select_rows(batch, rows, (C.PROMPT_IDS, C.RESPONSE_IDS)), "micro_batches": mbs,
                     "passes": plan.passes, "values": values}
                    for rows, mbs in zip(plan.rank_rows, plan.rank_micro_batches, strict=True)]
        replies = await self._run("compute_logprobs", group.call, "logprobs", payloads,
                                  timeout_s=self.config.timeout_s, what="compute_logprobs")
        logp = reassemble(plan.rank_rows, [r[0] for r in replies], batch.num_rows)
        out = {C.LOGPROBS: logp}
        if values:
            out[C.VALUES] = reassemble(plan.rank_rows, [r[1] for r in replies], batch.num_rows)
        return batch.with_columns(**out)

    # -- train ------------------------------------------------------------------

    async def train_step(self, batch: Batch, algorithm: Algorithm) -> dict[str, float]:
        group = self._ready()
        self._validate(batch, (C.PROMPT_IDS, C.RESPONSE_IDS, C.ADVANTAGES, *algorithm.required_columns))
        algo_bytes, ctx = self._step_inputs(batch, algorithm)
        plan = self._plan(batch)
        payloads = [{"batch": select_rows(batch, rows), "micro_batches": mbs, "passes": plan.passes, "ctx": ctx,
                     "algorithm": algo_bytes}
                    for rows, mbs in zip(plan.rank_rows, plan.rank_micro_batches, strict=True)]
        replies = await self._run("train_step", group.call, "train", payloads, timeout_s=self.config.timeout_s,
                                  what="train_step")
        return self._finish_step(replies, plan.passes)

    # -- helpers ----------------------------------------------------------------

    def _validate(self, batch: Batch, names: tuple[str, ...]) -> None:
        self._check_batch(batch, names, vocab=int(self._info.get("vocab_size", 0)))

    def _plan(self, batch: Batch) -> StepPlan:
        lengths = batch[C.PROMPT_IDS].lengths + batch[C.RESPONSE_IDS].lengths  # type: ignore[union-attr]
        return plan_step(lengths, self.config.world_size, self.config.micro_batch_tokens)


__all__ = ["FSDPTrainEngine"]
