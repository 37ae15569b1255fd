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
import pickle
import weakref
from collections.abc import AsyncIterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncflow_core import columns as C
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Algorithm, LossContext, TrainEngine, TrainFeatures
from asyncflow_core.launchers.ranks import RankHandle, gpus_for_ranks, start_rank_group
from asyncflow_core.types import Batch, RaggedTensor, WeightBucket
from asyncflow_fsdp.config import FSDPTrainConfig
from asyncflow_fsdp.packing import StepPlan, plan_step

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


class FSDPTrainEngine(TrainEngine):
    """A Hugging Face causal LM sharded with FSDP2 over ``world_size`` spawned ranks.

    Methods are called one at a time (the runtime serialises them); a call
    made while another is running raises :class:`EngineError`.
    """

    def __init__(self, config: FSDPTrainConfig) -> None:
        self.config = config
        self._features = config.features()
        self._group: RankHandle | None = None
        self._version = 0
        self._busy: str | None = None
        self._info: dict[str, Any] = {}
        self._device_type = "cpu"
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
        """What rank 0 reported at setup: device, backend, vocab size, parameter count, architecture."""
        return dict(self._info)

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
        # an engine dropped without shutdown() still ends its ranks (daemonic ranks, and rank actors, also end with this process)
        self._finalizer = weakref.finalize(self, group.stop, grace_s=0)
        port = group.call("bind", timeout_s=c.setup_timeout_s, what="setup (rendezvous)")[0]
        infos = group.call("setup", same={"port": port, "device": self._device_type}, timeout_s=c.setup_timeout_s,
                           what="setup")
        self._info = infos[0]

    async def shutdown(self) -> None:
        group, self._group = self._group, None
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
        payloads = [{"batch": _rows(batch, rows, (C.PROMPT_IDS, C.RESPONSE_IDS)), "micro_batches": mbs,
                     "passes": plan.passes, "values": values}
                    for rows, mbs in zip(plan.rank_rows, plan.rank_micro_batches, strict=True)]
        replies = await self._run("compute_logprobs", group.call, "logprobs", payloads,
                                  timeout_s=self.config.timeout_s, what="compute_logprobs")
        logp = _reassemble(plan, [r[0] for r in replies], batch.num_rows)
        out = {C.LOGPROBS: logp}
        if values:
            out[C.VALUES] = _reassemble(plan, [r[1] for r in replies], batch.num_rows)
        return batch.with_columns(**out)

    # -- train ------------------------------------------------------------------

    async def train_step(self, batch: Batch, algorithm: Algorithm) -> dict[str, float]:
        group = self._ready()
        self._validate(batch, (C.PROMPT_IDS, C.RESPONSE_IDS, C.ADVANTAGES, *algorithm.required_columns))
        if batch.num_rows == 0:
            raise ValueError("train_step needs at least one row")
        try:
            algo_bytes = pickle.dumps(algorithm)
        except Exception as exc:
            raise ValueError(f"the algorithm must be picklable to reach the ranks: {exc}") from exc
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        ctx = LossContext(global_tokens=max(resp.numel_packed, 1), global_sequences=max(batch.num_rows, 1),
                          policy_version=self._version)
        plan = self._plan(batch)
        payloads = [{"batch": _rows(batch, rows), "micro_batches": mbs, "passes": plan.passes, "ctx": ctx,
                     "algorithm": algo_bytes}
                    for rows, mbs in zip(plan.rank_rows, plan.rank_micro_batches, strict=True)]
        replies = await self._run("train_step", group.call, "train", payloads, timeout_s=self.config.timeout_s,
                                  what="train_step")
        grad_norm = replies[0]["grad_norm"]
        if not replies[0]["stepped"]:
            raise EngineError(f"train_step: the gradient norm is {grad_norm} (not finite); the step was skipped and "
                              f"the weights are unchanged (version stays {self._version}). Check the algorithm's "
                              "inputs (advantages, log-probs) and the learning rate")
        self._version += 1
        tokens = sum(r["tokens"] for r in replies)
        weighted: dict[str, float] = {}
        for r in replies:
            for k, v in r["weighted"].items():
                weighted[k] = weighted.get(k, 0.0) + v
        out = {f"algo/{k}": v / max(tokens, 1) for k, v in weighted.items()}
        out.update(loss=sum(r["loss_sum"] for r in replies), grad_norm=grad_norm, micro_batches=float(plan.passes),
                   tokens=float(tokens))
        return out

    # -- weights ----------------------------------------------------------------

    async def export_weights(self, *, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        group = self._ready()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self._claim("export_weights")
        try:
            t = self.config.timeout_s
            chunks = (await asyncio.to_thread(group.call, "export_plan", same={"bucket_bytes": bucket_bytes},
                                              timeout_s=t, what="export_weights"))[0]
            index = 0
            for i in range(chunks):
                job = {"index": i, "version": self._version, "bucket_bytes": bucket_bytes}
                described = (await asyncio.to_thread(group.call, "export_chunk", same=job, timeout_s=t,
                                                     what=f"export_weights (bucket group {i})"))[0]
                # copy every segment of this group out at once: none is left behind if the consumer stops early
                buffers = [_from_shared_memory(d["shm"], d["nbytes"]) for d in described]
                for j, (d, buffer) in enumerate(zip(described, buffers, strict=True)):
                    last = i == chunks - 1 and j == len(described) - 1
                    yield WeightBucket(self._version, index, tuple(d["metas"]), buffer, d["checksum"], last)
                    index += 1
            await asyncio.to_thread(group.call, "export_done", timeout_s=t, what="export_weights")
        finally:
            self._busy = None

    async def save(self, path: Path) -> None:
        group = self._ready()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        await self._run("save", group.call, "save", same={"path": str(path), "version": self._version},
                        timeout_s=self.config.timeout_s, what=f"save({path})")

    async def load(self, path: Path) -> None:
        group = self._ready()
        path = Path(path)
        meta_file = path / "asyncflow_fsdp.json"
        if not meta_file.is_file():
            raise EngineError(f"no complete fsdp checkpoint at {path} (no {meta_file.name}); give the directory "
                              "save() wrote")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != "asyncflow-fsdp/1":
            raise EngineError(f"{meta_file} has format {meta.get('format')!r}; this engine reads asyncflow-fsdp/1")
        versions = await self._run("load", group.call, "load", same={"path": str(path)},
                                   timeout_s=self.config.timeout_s, what=f"load({path})")
        self._version = int(versions[0])

    async def export_pretrained(self, path: Path) -> None:
        """Write a Hugging Face ``save_pretrained`` directory (weights in the export dtype, config, tokenizer files).

        The result loads with ``AutoModelForCausalLM.from_pretrained(path)``. The value head is not part of it.
        """
        group = self._ready()
        path = Path(path)
        await self._run("export_hf", group.call, "export_hf", same={"path": str(path)},
                        timeout_s=self.config.timeout_s, what=f"export_hf({path})")

    # -- helpers ----------------------------------------------------------------

    def _ready(self) -> RankHandle:
        if self._group is None:
            raise EngineError("call setup() before using the fsdp train engine (or it was shut down)")
        return self._group

    def _claim(self, what: str) -> None:
        if self._busy is not None:
            raise EngineError(f"{what} called while {self._busy} is running; the engine runs one call at a time "
                              "(finish or close the export iterator first)")
        self._busy = what

    async def _run(self, label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run blocking ``fn`` off the event loop, one engine call at a time."""
        self._claim(label)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            self._busy = None

    def _validate(self, batch: Batch, names: tuple[str, ...]) -> None:
        missing = [n for n in dict.fromkeys(names) if n not in batch]
        if missing:
            raise ValueError(f"batch lacks columns {missing}; it has {sorted(batch.columns)}")
        vocab = int(self._info.get("vocab_size", 0))
        for name in (C.PROMPT_IDS, C.RESPONSE_IDS):
            ids = batch[name]
            if not isinstance(ids, RaggedTensor):
                raise ValueError(f"{name} must be a ragged column (RaggedTensor), got {type(ids).__name__}")
            if ids.values.is_floating_point() or ids.values.dim() != 1:
                raise ValueError(f"{name} must hold 1-D integer token ids, got {ids.values.dtype} "
                                 f"with shape {tuple(ids.values.shape)}")
            if ids.numel_packed and (int(ids.values.min()) < 0 or int(ids.values.max()) >= vocab):
                raise ValueError(f"{name} holds token ids outside the model's vocabulary [0, {vocab})")
        if batch.num_rows and bool((batch[C.PROMPT_IDS].lengths == 0).any()):  # type: ignore[union-attr]
            raise ValueError("every row needs a non-empty prompt (the first response token is scored from it)")
        for name in (C.ADVANTAGES, C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS):
            col = batch.get(name)
            if isinstance(col, RaggedTensor) and not torch.equal(col.offsets, batch[C.RESPONSE_IDS].offsets):
                raise ValueError(f"{name} is not aligned with response_ids (different lengths per row)")

    def _plan(self, batch: Batch) -> StepPlan:
        lengths = batch[C.PROMPT_IDS].lengths + batch[C.RESPONSE_IDS].lengths  # type: ignore[union-attr]
        return plan_step(lengths, self.config.world_size, self.config.micro_batch_tokens)


def _rows(batch: Batch, rows: torch.Tensor, names: tuple[str, ...] | None = None) -> Batch:
    part = batch.select(rows)
    part = part.project(list(names)) if names is not None else part
    return Batch(dict(part), num_rows=part.num_rows)  # no row ids: the ranks do not need them


def _reassemble(plan: StepPlan, per_rank: list[list[torch.Tensor]], rows: int) -> RaggedTensor:
    """Per-rank per-row pieces back into the batch's row order."""
    pieces: list[torch.Tensor] = [torch.empty(0, dtype=torch.float32)] * rows
    for rank_rows, rank_pieces in zip(plan.rank_rows, per_rank, strict=True):
        for row, piece in zip(rank_rows.tolist(), rank_pieces, strict=True):
            pieces[row] = piece.to(torch.float32)
    return RaggedTensor.from_sequences(pieces, dtype=torch.float32)


def _from_shared_memory(name: str, nbytes: int) -> torch.Tensor:
    """Copy a rank's bucket out of its shared-memory segment into a tensor this process owns; unlink the segment."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        out = torch.empty(nbytes, dtype=torch.uint8)
        src = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
        out.numpy()[:] = src
        del src
    finally:
        shm.close()
        shm.unlink()
    return out


__all__ = ["FSDPTrainEngine"]
