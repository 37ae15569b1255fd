"""The driver side a train engine over a rank group shares, whatever framework its ranks run (fsdp, megatron).

A rank-group engine keeps its framework in the ranks and a thin driver here:
one engine call at a time (:meth:`RankEngineDriver._run`), input checks
common to every causal LM trainer, the merge of the ranks' step replies into
metrics, and the rank protocol for weights and checkpoints that the engines'
workers implement alike:

- ``export_plan`` (how many groups of buckets), ``export_chunk`` (one group,
  each bucket in a shared-memory segment the driver maps: one the rank keeps
  across versions, under a shared lock while mapped, or a fresh one it
  unlinks), ``export_done``;
- ``save`` (every rank writes its part, then ``asyncflow_<name>.json`` with
  format ``asyncflow-<name>/1``), ``load``, ``export_hf``.

The engine class mixes :class:`RankEngineDriver` in, sets ``engine_name`` and
keeps ``config`` (with ``timeout_s``), ``_group``, ``_busy`` and ``_version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import pickle
from collections.abc import AsyncIterator, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import EngineError
from asyncflow_core.interfaces import Algorithm, LossContext
from asyncflow_core.kept_segments import map_shared
from asyncflow_core.launchers.rank_worker import FRESH_PREFIX, KEPT_PREFIX, SHM_DIR
from asyncflow_core.launchers.ranks import RankHandle
from asyncflow_core.types import Batch, RaggedTensor, WeightBucket


class RankEngineDriver:
    """Mixin: the driver-side calls of a train engine whose ranks speak the shared protocol (see the module)."""

    engine_name: ClassVar[str] = "rank"
    config: Any
    _group: RankHandle | None
    _busy: str | None
    _version: int

    # -- one call at a time -----------------------------------------------------

    def _ready(self) -> RankHandle:
        if self._group is None:
            raise EngineError(f"call setup() before using the {self.engine_name} train engine (or it was shut down)")
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

    # -- input ------------------------------------------------------------------

    @staticmethod
    def _check_batch(batch: Batch, names: Sequence[str], *, vocab: int, max_positions: int | None = None) -> None:
        """Raise ``ValueError`` saying what is wrong with ``batch`` for a causal LM with ``vocab`` token ids."""
        missing = [n for n in dict.fromkeys(names) if n not in batch]
        if missing:
            raise ValueError(f"batch lacks columns {missing}; it has {sorted(batch.columns)}")
        for name in (C.PROMPT_IDS, C.RESPONSE_IDS):
            ids = batch[name]
            if not isinstance(ids, RaggedTensor):
                raise ValueError(f"{name} must be a ragged column (RaggedTensor), got {type(ids).__name__}")
            if ids.values.is_floating_point() or ids.values.dim() != 1:
                raise ValueError(f"{name} must hold 1-D integer token ids, got {ids.values.dtype} "
                                 f"with shape {tuple(ids.values.shape)}")
            if ids.numel_packed and (int(ids.values.min()) < 0 or int(ids.values.max()) >= vocab):
                raise ValueError(f"{name} holds token ids outside the model's vocabulary [0, {vocab})")
        prompt_lengths = batch[C.PROMPT_IDS].lengths  # type: ignore[union-attr]
        if batch.num_rows and bool((prompt_lengths == 0).any()):
            raise ValueError("every row needs a non-empty prompt (the first response token is scored from it)")
        if max_positions is not None and batch.num_rows:
            longest = int((prompt_lengths + batch[C.RESPONSE_IDS].lengths).max())  # type: ignore[union-attr]
            if longest > max_positions:
                raise ValueError(f"a row has {longest} tokens, more than the model's max_position_embeddings "
                                 f"{max_positions}")
        for name in (C.ADVANTAGES, C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS):
            col = batch.get(name)
            if isinstance(col, RaggedTensor) and not torch.equal(col.offsets, batch[C.RESPONSE_IDS].offsets):
                raise ValueError(f"{name} is not aligned with response_ids (different lengths per row)")

    # -- train step -------------------------------------------------------------

    def _step_inputs(self, batch: Batch, algorithm: Algorithm) -> tuple[bytes, LossContext]:
        """The pickled algorithm and the loss context every rank of a train step gets."""
        if batch.num_rows == 0:
            raise ValueError("train_step needs at least one row")
        try:
            algo_bytes = pickle.dumps(algorithm)
        except Exception as exc:
            raise ValueError(f"the algorithm must be picklable to reach the ranks: {exc}") from exc
        # global_tokens counts the tokens the loss applies to (the unmasked ones under a loss_mask column)
        return algo_bytes, LossContext.of(batch, self._version)

    def _finish_step(self, replies: list[dict[str, Any]], passes: int) -> dict[str, float]:
        """Count the step (or say why it was skipped) and merge the answering ranks' sums into the step's metrics.

        A reply with ``answers: False`` (a rank whose numbers another rank of
        its replica reports) is left out of the sums.
        """
        grad_norm = replies[0]["grad_norm"]
        if not replies[0]["stepped"]:
            raise EngineError(f"train_step: the gradient norm is {grad_norm} (not finite); the step was skipped and "
                              f"the weights are unchanged (version stays {self._version}). Check the algorithm's "
                              "inputs (advantages, log-probs) and the learning rate")
        self._version += 1
        answering = [r for r in replies if r.get("answers", True)]
        tokens = sum(r["tokens"] for r in answering)
        weighted: dict[str, float] = {}
        for r in answering:
            for k, v in r["weighted"].items():
                weighted[k] = weighted.get(k, 0.0) + v
        out = {f"algo/{k}": v / max(tokens, 1) for k, v in weighted.items()}
        out.update(loss=sum(r["loss_sum"] for r in answering), grad_norm=grad_norm, micro_batches=float(passes),
                   tokens=float(tokens))
        return out

    # -- weights and checkpoints ----------------------------------------------------

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
                buffers = [from_shared_memory(d["shm"], d["nbytes"], kept=d.get("kept")) for d in described]
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
        name = self.engine_name
        meta_file = path / f"asyncflow_{name}.json"
        if not meta_file.is_file():
            raise EngineError(f"no complete {name} checkpoint at {path} (no {meta_file.name}); give the directory "
                              "save() wrote")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != f"asyncflow-{name}/1":
            raise EngineError(f"{meta_file} has format {meta.get('format')!r}; this engine reads asyncflow-{name}/1")
        versions = await self._run("load", group.call, "load", same={"path": str(path)},
                                   timeout_s=self.config.timeout_s, what=f"load({path})")
        self._version = int(versions[0])

    async def export_pretrained(self, path: Path) -> None:
        """Write a Hugging Face directory (weights in the export dtype, ``config.json``, tokenizer files).

        The result loads with ``AutoModelForCausalLM.from_pretrained(path)``.
        """
        group = self._ready()
        await self._run("export_hf", group.call, "export_hf", same={"path": str(Path(path))},
                        timeout_s=self.config.timeout_s, what=f"export_pretrained({path})")


def select_rows(batch: Batch, rows: torch.Tensor, names: Sequence[str] | None = None) -> Batch:
    """``batch``'s ``rows`` (and only the columns ``names``), without row ids: what a rank is sent."""
    part = batch.select(rows)
    part = part.project(list(names)) if names is not None else part
    return Batch(dict(part), num_rows=part.num_rows)


def reassemble(rank_rows: Sequence[torch.Tensor], pieces: Sequence[Sequence[torch.Tensor]], rows: int) -> RaggedTensor:
    """Per-row pieces, grouped as ``rank_rows`` planned them, back into the batch's row order."""
    out: list[torch.Tensor] = [torch.empty(0, dtype=torch.float32)] * rows
    for planned, got in zip(rank_rows, pieces, strict=True):
        for row, piece in zip(planned.tolist(), got, strict=True):
            out[row] = piece.to(torch.float32)
    return RaggedTensor.from_sequences(out, dtype=torch.float32)


#: Where POSIX shared-memory segments appear as files (Linux); elsewhere buckets are copied out instead
_SHM_DIR = SHM_DIR


def from_shared_memory(name: str, nbytes: int, *, kept: bool | None = None) -> torch.Tensor:
    """A rank's bucket as a tensor this process maps (or owns).

    On Linux the segment is mapped, not copied: the tensor holds the mapping
    (``torch.frombuffer`` keeps the ``mmap`` alive) and the memory goes when
    the last tensor using it goes. A segment the rank keeps across versions
    (``kept``; by default told by its name, :data:`KEPT_PREFIX`) is mapped
    under a shared ``flock`` that lasts as long as the mapping (``mmap``
    holds a duplicate of the descriptor, and the lock belongs to the open
    file): the rank does not rewrite it until then, and its name is left
    for the rank to reuse. Any other segment's name is unlinked at once. The
    bytes were written by the rank before it answered, so nothing else
    writes them while they are mapped. Elsewhere they are copied out of the
    segment.
    """
    path = _SHM_DIR / name.lstrip("/")
    if kept is None:
        kept = path.name.startswith(KEPT_PREFIX)
    if kept:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise EngineError(f"the rank's shared-memory segment {name} is gone (was its rank closed or killed "
                              "during the export?); export the weights again") from None
        try:
            mapped = map_shared(fd, nbytes)  # keeps a duplicate of fd, and with it the shared lock, until it unmaps
        finally:
            os.close(fd)
        if mapped is None:
            raise EngineError(f"the rank is still writing shared-memory segment {name}; this is a bug in the "
                              "rank's export, please report it")
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)
    if nbytes > 0 and path.is_file():
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
            os.unlink(path)
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)
    if path.is_file() and path.name.startswith(FRESH_PREFIX):  # an empty bucket's placeholder
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return torch.empty(0, dtype=torch.uint8)
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


__all__ = ["RankEngineDriver", "from_shared_memory", "reassemble", "select_rows"]
