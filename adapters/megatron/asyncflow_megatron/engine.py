"""The ``megatron`` TrainEngine, driver side: checks versions and the model, plans the step, commands the ranks.

The engine object lives in the caller's process (the flow runtime's event
loop). ``setup()`` checks the installed megatron-core, maps the Hugging Face
config and checks that it splits over the TP x PP grid (all before a rank
starts), then starts ``world_size`` ranks (:mod:`asyncflow_megatron.worker`) with the
process's rank spawner (child processes by default, one Ray actor each under
the ``ray`` launcher). Every later call validates its input
here, splits the rows over the data-parallel replicas (token-balanced) and
into micro-batches, sends every rank its replica's share, and waits for all
of them off the event loop.

Ranks are started and watched by the core's rank group
(:mod:`asyncflow_core.launchers.ranks`); rows are planned by the core's
:func:`~asyncflow_core.launchers.packing.plan_step`, as for every rank-group engine.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from pathlib import Path
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import ConfigError, EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Algorithm, TrainEngine, TrainFeatures
from asyncflow_core.launchers.packing import StepPlan, plan_step
from asyncflow_core.launchers.rank_driver import RankEngineDriver, reassemble, select_rows
from asyncflow_core.launchers.ranks import RankHandle, gpus_for_ranks, start_rank_group
from asyncflow_core.types import Batch
from asyncflow_megatron import hf_mapping as hm
from asyncflow_megatron.checkpoint import load_problem
from asyncflow_megatron.config import LORA_REFUSAL, MegatronTrainConfig
from asyncflow_megatron.versions import require_megatron

#: imported by the forkserver once (start_method forkserver), so forking a rank skips the megatron import
FORKSERVER_PRELOAD = ("asyncflow_megatron.worker", "megatron.core.models.gpt.gpt_model")


def check_model(config: MegatronTrainConfig) -> hm.Architecture:
    """Map the configured model and check it against the parallel sizes; raise :class:`EngineError` saying why not."""
    from asyncflow_plugins.hf.model import hf_config

    if config.model is None or (config.model.path is None and config.model.hf_config is None):
        raise EngineError("the megatron engine has no model: set model.path (a local Hugging Face checkpoint) or "
                          "model.hf_config (an architecture to build) in the run's `model` section or the engine's "
                          "`model` option")
    try:
        arch = hm.architecture_from_hf(hf_config(config.model))
        hm.check_parallelism(arch, config.tensor_parallel_size, config.pipeline_parallel_size)
    except (ValueError, ConfigError) as exc:
        raise EngineError(f"megatron engine: {exc}") from None
    return arch


class MegatronTrainEngine(RankEngineDriver, TrainEngine):
    """A Hugging Face-architecture policy as a megatron-core GPTModel over ``world_size`` spawned ranks.

    Methods are called one at a time (the runtime serialises them); a call
    made while another is running raises :class:`EngineError`.
    """

    engine_name = "megatron"

    def __init__(self, config: MegatronTrainConfig) -> None:
        if config.lora is not None:
            raise UnsupportedFeatureError(LORA_REFUSAL)
        self.config = config
        self._features = config.features()
        self._group: RankHandle | None = None
        self._version = 0
        self._busy: str | None = None
        self._infos: list[dict[str, Any]] = []
        self._arch: hm.Architecture | None = None
        self._finalizer: weakref.finalize | None = None

    # -- properties -------------------------------------------------------------

    @property
    def features(self) -> TrainFeatures:
        return self._features

    @property
    def version(self) -> int:
        return self._version

    @property
    def info(self) -> dict[str, Any]:
        """What rank 0 reported at setup: device, backend, layer implementation, parallel sizes, architecture."""
        return dict(self._infos[0]) if self._infos else {}

    @property
    def rank_devices(self) -> list[str]:
        """The device each rank reported at setup, by rank (``cuda:r`` on a host whose GPUs every rank sees)."""
        return [str(info["device"]) for info in self._infos]

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the ranks (empty before setup and after shutdown)."""
        return self._group.pids if self._group is not None else []

    # -- lifecycle --------------------------------------------------------------

    async def setup(self) -> None:
        if self._group is not None:
            raise EngineError("setup() was already called on this megatron engine")
        require_megatron()
        self._arch = check_model(self.config)
        c = self.config
        if c.device == "cuda":
            have = gpus_for_ranks(c.world_size)  # where the ranks will run: this host's GPUs, or their actors'
            if have < c.world_size:
                raise EngineError(f"the megatron engine needs one GPU per rank: world_size={c.world_size}, "
                                  f"{have} visible; lower world_size (device: cpu runs on gloo, for tests only)")
            if c.sequence_parallel:
                from asyncflow_megatron.model import resolve_impl

                if resolve_impl(c.transformer_impl, "cuda") != "transformer_engine":
                    raise EngineError("sequence_parallel needs Transformer Engine layers, and transformer_engine "
                                      "does not import here: pip install 'asyncflow-megatron[te]' or turn "
                                      "sequence_parallel off")
        await self._run("setup", self._start)

    def _start(self) -> None:
        from asyncflow_megatron.worker import rank_main

        c = self.config
        group = start_rank_group(c.world_size, rank_main, (c.model_dump(mode="json"),), start_method=c.start_method,
                                 preload=FORKSERVER_PRELOAD, name="asyncflow-megatron-rank")
        self._group = group
        # an engine dropped without shutdown() still ends its ranks (daemonic ranks and rank actors also end with
        # this process)
        self._finalizer = weakref.finalize(self, group.stop, grace_s=0)
        port = group.call("bind", timeout_s=c.setup_timeout_s, what="setup (rendezvous)")[0]
        self._infos = group.call("setup", same={"port": port}, timeout_s=c.setup_timeout_s, what="setup")

    async def shutdown(self) -> None:
        group, self._group = self._group, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if group is not None:
            await asyncio.to_thread(group.stop)

    async def load(self, path: Path) -> None:
        """Restore a checkpoint of :meth:`save`; one whose optimizer layout this engine cannot read is refused first."""
        meta_file = Path(path) / "asyncflow_megatron.json"
        if meta_file.is_file():
            c = self.config
            problem = load_problem(json.loads(meta_file.read_text()), distributed=c.use_distributed_optimizer,
                                   tp=c.tensor_parallel_size, pp=c.pipeline_parallel_size)
            if problem:
                raise EngineError(f"cannot load {path}: {problem}")
        await super().load(path)

    # -- forward ----------------------------------------------------------------

    async def compute_logprobs(self, batch: Batch, *, values: bool = False) -> Batch:
        group = self._ready()
        if values:
            raise UnsupportedFeatureError("the megatron engine has no value head (supports_values is false); use "
                                          "an algorithm without a critic (grpo, rloo, reinforce_pp)")
        self._validate(batch, (C.PROMPT_IDS, C.RESPONSE_IDS))
        plan = self._plan(batch)
        payloads = self._per_rank(plan, batch, (C.PROMPT_IDS, C.RESPONSE_IDS), {})
        replies = await self._run("compute_logprobs", group.call, "logprobs", payloads,
                                  timeout_s=self.config.timeout_s, what="compute_logprobs")
        per_replica = self._answers(replies)
        return batch.with_columns(**{C.LOGPROBS: reassemble(plan.rank_rows, per_replica, batch.num_rows)})

    # -- train ------------------------------------------------------------------

    async def train_step(self, batch: Batch, algorithm: Algorithm) -> dict[str, float]:
        group = self._ready()
        self._validate(batch, (C.PROMPT_IDS, C.RESPONSE_IDS, C.ADVANTAGES, *algorithm.required_columns))
        algo_bytes, ctx = self._step_inputs(batch, algorithm)
        plan = self._plan(batch)
        payloads = self._per_rank(plan, batch, None, {"ctx": ctx, "algorithm": algo_bytes})
        replies = await self._run("train_step", group.call, "train", payloads, timeout_s=self.config.timeout_s,
                                  what="train_step")
        return self._finish_step(replies, plan.passes)

    # -- helpers ----------------------------------------------------------------

    def _per_rank(self, plan: StepPlan, batch: Batch, names: tuple[str, ...] | None,
                  extra: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank gets its data-parallel replica's rows (all TP and PP ranks of a replica see the same rows)."""
        replicas = [{"batch": select_rows(batch, rows, names), "micro_batches": mbs, **extra}
                    for rows, mbs in zip(plan.rank_rows, plan.rank_micro_batches, strict=True)]
        return [replicas[info["dp_rank"]] for info in self._infos]

    def _answers(self, replies: list[Any]) -> list[list[torch.Tensor]]:
        """The replies of each replica's reporting rank (last stage, TP rank 0), by data-parallel rank."""
        out: list[list[torch.Tensor]] = [[] for _ in range(self.config.data_parallel_size)]
        for info, reply in zip(self._infos, replies, strict=True):
            if reply is not None:
                out[info["dp_rank"]] = reply
        return out

    def _validate(self, batch: Batch, names: tuple[str, ...]) -> None:
        arch = self._arch
        self._check_batch(batch, names, vocab=arch.vocab_size if arch else 0,
                          max_positions=arch.max_position_embeddings if arch else None)

    def _plan(self, batch: Batch) -> StepPlan:
        lengths = batch[C.PROMPT_IDS].lengths + batch[C.RESPONSE_IDS].lengths  # type: ignore[union-attr]
        return plan_step(lengths, self.config.data_parallel_size, self.config.micro_batch_tokens)


__all__ = ["MegatronTrainEngine", "check_model"]
