"""Writes finished generations to the store as the rollout columns, in batches, and acknowledges their leases.

A request is written once (its result, or None for a row settled without
one: placeholder columns). Writes are batched: 64 rows at once, or
whatever arrived within ``interval_s`` of the first; a lease is
acknowledged once every row it carried was written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import FinishReason, GenerationResult, RaggedTensor

#: The columns the rollout writes per row.
ROLLOUT_OUT = (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.RESPONSE_VERSIONS, C.TRUNCATED)

_BATCH_ROWS = 64


class TrajectoryWriter:
    """Buffers ``(request, result)`` pairs and puts them as :data:`ROLLOUT_OUT` columns.

    A request has ``row`` and ``lease`` (with ``meta`` and a ``remaining`` row count). ``spawn`` runs the
    timed flush as a task of the owner; ``on_written`` is called after each flush.
    """

    def __init__(self, stage: str, *, interval_s: float, spawn: Callable[[Any], None],
                 on_written: Callable[[], None]) -> None:
        self.stage = stage
        self.interval_s = interval_s
        self.spawn = spawn
        self.on_written = on_written
        self.ctx: Any = None  #: the run's context (store, version, counters), given by the owning stage's bind
        self._buffer: list[tuple[Any, GenerationResult | None]] = []
        self._flush_scheduled = False

    async def write(self, req: Any, res: GenerationResult | None) -> None:
        self._buffer.append((req, res))
        if len(self._buffer) >= _BATCH_ROWS:
            await self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(self.interval_s, lambda: self.spawn(self.flush()))

    async def flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer:
            return
        ctx = self.ctx
        items, self._buffer = self._buffer, []
        rows = torch.tensor([q.row for q, _ in items], dtype=torch.int64)
        ids, lps, vers, lengths, vrange, cut = [], [], [], [], [], []
        for _, res in items:
            cut.append(res is not None and res.finish_reason is FinishReason.LENGTH)
            if res is None:
                ids.append(torch.empty(0, dtype=torch.int64))
                lps.append(torch.empty(0, dtype=torch.float32))
                vers.append(torch.empty(0, dtype=torch.int64))
                lengths.append(0)
                vrange.append((ctx.version, ctx.version))
                continue
            ids.append(torch.as_tensor(res.token_ids, dtype=torch.int64))
            lps.append(torch.as_tensor(res.logprobs, dtype=torch.float32))
            # versions are stored at the width of the token ids: lengths-only (zero-width) ids of a simulated
            # engine get lengths-only versions (the row's version range is put beside them, below)
            v = torch.as_tensor(res.versions, dtype=torch.int64)
            vers.append(v if ids[-1].dim() == 1 else v.new_empty((v.shape[0], *ids[-1].shape[1:])))
            lengths.append(len(res.token_ids))
            lo = res.min_version if res.min_version is not None else ctx.version
            hi = res.max_version if res.max_version is not None else ctx.version
            vrange.append((lo, hi))
        lens = torch.tensor(lengths, dtype=torch.int64)
        cols = {
            C.RESPONSE_IDS: RaggedTensor.from_lengths(torch.cat(ids), lens),
            C.BEHAVIOR_LOGPROBS: RaggedTensor.from_lengths(torch.cat(lps), lens),
            C.RESPONSE_VERSIONS: RaggedTensor.from_lengths(torch.cat(vers), lens),
            C.TRUNCATED: torch.tensor(cut, dtype=torch.bool),
        }
        await ctx.store.put(cols, rows=BatchMeta(row_ids=rows), versions=torch.tensor(vrange))
        ctx.processed[self.stage] += len(items)
        ctx.counters["tokens_generated"] += int(lens.sum())
        done: dict[int, Any] = {}
        for q, _ in items:
            q.lease.remaining -= 1
            if q.lease.remaining == 0:
                done[id(q.lease)] = q.lease
        for lease in done.values():
            await ctx.store.ack(lease.meta)
        self.on_written()
