"""The standard RL pipeline's stages: feeder -> rollout -> reward -> (ref / old log-probs) -> advantage -> train.

Each is a :class:`~asyncflow_core.flow.stage.Stage`; see
``docs/architecture.md`` ("The flow runtime") for how they overlap and how
the staleness bound is enforced (:mod:`asyncflow_core.flow.staleness`).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import AsyncflowError, ConfigError, EngineError
from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.outcomes import RowOutcome, merge_outputs
from asyncflow_core.flow.stage import RunStopped, Stage, StageOutput
from asyncflow_core.flow.tokenizer import Tokenizer
from asyncflow_core.interfaces import (
    Algorithm,
    Dataset,
    KVCachePolicy,
    PauseMode,
    Reward,
    RolloutEngine,
    TrainEngine,
    WeightTransport,
)
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import (
    Batch,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RaggedTensor,
    RewardInput,
    SamplingParams,
    WeightBucket,
)

log = logging.getLogger("asyncflow.flow")

ROLLOUT_OUT = (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.RESPONSE_VERSIONS, C.TRUNCATED)

def _as_tuple(values: Sequence[Any] | torch.Tensor) -> tuple:
    """A result field (sequence or 1-D tensor) as a tuple of Python numbers, without a per-element loop.

    Zero-width (lengths-only) values become that many empty entries: only their count means anything.
    """
    if isinstance(values, torch.Tensor):
        if values.dim() > 1 and 0 in values.shape[1:]:
            return ((),) * values.shape[0]
        return tuple(values.tolist())
    return tuple(values)


# ------------------------------------------------------------------------------------------- feeder


class PromptFeeder(Stage):
    """Puts ``n`` rows per admitted prompt (a group), under the admission bound; re-queued prompts first."""

    name = "feeder"
    produces = (C.PROMPT_IDS, C.GROUP_ID)

    def __init__(self, dataset: Dataset, tokenizer: Tokenizer, *, epochs: int, shuffle: bool, seed: int,
                 max_prompts: int | None = None) -> None:
        self.dataset = dataset
        #: most prompts (net of dropped ones) the run can ever train (total_steps x B): starting more only wastes
        #: rollout work, and whether they start before the last step ends would depend on timing
        self.max_prompts = max_prompts
        self.tokenizer = tokenizer
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self._token_cache: dict[int, tuple[int, ...]] = {}

    def _order(self) -> AsyncIterator[int] | Any:
        n = len(self.dataset)
        for epoch in range(self.epochs):
            if self.shuffle:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            else:
                perm = list(range(n))
            for idx in perm:
                yield epoch * n + idx, idx

    def _tokens(self, index: int) -> tuple[int, ...]:
        ids = self._token_cache.get(index)
        if ids is None:
            rec = self.dataset[index]
            try:
                ids = tuple(rec.prompt_token_ids) or tuple(self.tokenizer.encode(rec.prompt))
            except ConfigError as exc:
                raise ConfigError(f"dataset record {index}: {exc}") from None
            if not ids:
                raise RunStopped(f"dataset record {index} has an empty prompt; remove it or give it text")
            self._token_cache[index] = ids
        return ids

    async def run(self) -> None:
        ctx, led = self.ctx, self.ctx.ledger
        order = iter(self._order())
        exhausted = False
        while not ctx.stop.is_set():
            def can_go() -> bool:
                admit = not exhausted and led.net_started < self._limit()
                return bool(led.requeue) or admit or (exhausted and led.outstanding == 0)

            if not can_go():
                with ctx.timeline.span(self.name, "admission_wait"):
                    await ctx.wait_for(can_go)
            if ctx.stop.is_set():
                return
            groups = []
            while led.requeue:
                info = led.requeue.popleft()
                groups.append(led.new_group(info.prompt_uid, info.record, info.attempt))
            while not exhausted and led.net_started < self._limit():
                nxt = next(order, None)
                if nxt is None:
                    exhausted = True
                    break
                uid, idx = nxt
                if uid in led.trained or uid in led.dropped:
                    continue  # settled before a resume
                groups.append(led.admit(uid, self.dataset[idx]))
            if groups:
                await self._put(groups)
            elif exhausted and led.outstanding == 0 and not led.requeue:
                await ctx.store.end_stream()
                return

    def _limit(self) -> int:
        ctx = self.ctx
        limit = S.admission_limit(ctx.version, ctx.k, ctx.prompts_per_step)
        return limit if self.max_prompts is None else min(limit, self.max_prompts)

    async def _put(self, groups: list) -> None:
        n = self.ctx.n
        seqs: list[torch.Tensor] = []
        gids: list[int] = []
        for g in groups:
            ids = torch.tensor(self._tokens(g.record.index), dtype=torch.int64)
            seqs.extend([ids] * n)
            gids.extend([g.group_id] * n)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        prompt = RaggedTensor.from_lengths(torch.cat(seqs), lengths)
        await self.ctx.store.put({C.PROMPT_IDS: prompt, C.GROUP_ID: torch.tensor(gids, dtype=torch.int64)},
                                 group_ids=torch.tensor(gids, dtype=torch.int64))
        self.ctx.counters["prompts_started"] += len(groups)


# ------------------------------------------------------------------------------------------ rollout


@dataclass
class _Lease:
    meta: BatchMeta
    remaining: int


@dataclass
class _Req:
    row: int
    lease: _Lease
    prompt: tuple[int, ...]
    group: int
    attempt: int = 0
    prefix_ids: tuple[int, ...] = ()
    prefix_lps: tuple[float, ...] = ()
    prefix_versions: tuple[int, ...] = ()
    start_version: int = 0  #: oldest version its tokens can have (replica version at submission, or the prefix's)

    @property
    def request_id(self) -> str:
        return f"row{self.row}-try{self.attempt}"


@dataclass
class Replica:
    index: int
    engine: RolloutEngine
    inflight: dict[str, _Req] = field(default_factory=dict)
    dead: bool = False
    updating: bool = False
    generation: int = 0  #: +1 per death: work started for an earlier incarnation must not touch this one
    reviving: bool = False  #: dead, and its engine is being restarted
    sync_generation: int = -1  #: the incarnation whose weight-sync task is running (one task per incarnation)

    @property
    def lane(self) -> str:
        return f"rollout/{self.index}"


class RolloutStage(Stage):
    """Dispatches prompt rows to engine replicas, writes completions row by row as they finish.

    One dispatcher leases rows (up to the replicas' free slots) and assigns
    each to the eligible replica with the most free slots; a replica is
    eligible when alive, not full, and its weights are inside the bound
    (:func:`~asyncflow_core.flow.staleness.engine_may_start`). Per replica a
    weight-sync task pulls each published version from the transport and
    applies it at a safe point (in flight when the engine supports it,
    otherwise pause(abort) -> update -> resume, re-submitting the aborted
    requests with their tokens as a prefix when the engine can resume).
    """

    name = "rollout"
    consumes = (C.PROMPT_IDS, C.GROUP_ID)
    produces = ROLLOUT_OUT

    def __init__(
        self, replicas: list[RolloutEngine], transport: WeightTransport, sampling: SamplingParams, *,
        max_inflight: int, rows_per_lease: int, lease_s: float, write_interval_s: float, deadline_s: float,
        kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE,
    ) -> None:
        self.replicas = [Replica(i, e) for i, e in enumerate(replicas)]
        self.transport = transport
        self.sampling = sampling
        self.max_inflight = max_inflight
        self.rows_per_lease = rows_per_lease
        self.lease_s = lease_s
        self.write_interval_s = write_interval_s
        self.deadline_s = deadline_s
        self.kv_cache = kv_cache
        self._pending: list[_Req] = []
        self._buffer: list[tuple[_Req, GenerationResult | None]] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self._busy_since: dict[int, float] = {}
        self._wake = asyncio.Event()  # dispatcher wake-up: slots freed, weights updated, version moved
        self._alive = len(self.replicas)
        self._inflight_total = 0
        # (in flight - max_inflight, index) per replica, most free slots first: pushed whenever a replica's load
        # changes, so a dispatch pops the few replicas it assigns to instead of sorting every replica (entries
        # that no longer match the replica's load are skipped)
        self._by_free = [(-max_inflight, i) for i in range(len(self.replicas))]
        self._last_death: str | None = None  #: the error of the replica that died last, for the stop message
        self.weights_pushed = False  #: a version is staged in the transport (a restarted replica must load it)

    def _poke(self) -> None:
        self._wake.set()

    async def _wait_until(self, predicate: Any) -> None:
        """Dispatcher wait; woken by its own events (per result) rather than the run-wide condition."""
        while not predicate() and not self.ctx.stop.is_set():
            self._wake.clear()
            await self._wake.wait()

    # -- helpers -----------------------------------------------------------------------

    def _eligible(self, r: Replica) -> bool:
        return (not r.dead and not r.updating and len(r.inflight) < self.max_inflight
                and S.engine_may_start(r.engine.version, self.ctx.version, self.ctx.k))

    def _free_slots(self, enough: int | None = None) -> int:
        """Free slots of eligible replicas (counting stops once ``enough`` are found)."""
        total = 0
        for r in self.replicas:
            if self._eligible(r):
                total += self.max_inflight - len(r.inflight)
                if enough is not None and total >= enough:
                    break
        return total

    def _load_changed(self, r: Replica) -> None:
        heapq.heappush(self._by_free, (len(r.inflight) - self.max_inflight, r.index))
        if len(self._by_free) > 4 * len(self.replicas) + 1024:  # drop stale entries
            self._by_free = [(len(q.inflight) - self.max_inflight, q.index) for q in self.replicas]
            heapq.heapify(self._by_free)

    def _worth_leasing(self) -> bool:
        """Cheap test first (counters, O(1) per wake-up), the exact count only when it may pass."""
        upper = self._alive * self.max_inflight - self._inflight_total - len(self._pending)
        want = min(self.rows_per_lease, max(1, self._alive * self.max_inflight // 8))
        return upper >= want and self._free_slots(want + len(self._pending)) - len(self._pending) >= want

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.ctx.halt(f"rollout stage failed: {type(exc).__name__}: {exc}")

    def _mark_busy(self, r: Replica) -> None:
        now = self.ctx.clock()
        if r.inflight and r.index not in self._busy_since:
            self._busy_since[r.index] = now
        elif not r.inflight and r.index in self._busy_since:
            self.ctx.timeline.add(r.lane, "generate", self._busy_since.pop(r.index), now)

    # -- dispatch ------------------------------------------------------------------------

    async def run(self) -> None:
        ctx = self.ctx
        ctx.listeners.append(self._wake)
        for r in self.replicas:
            self._spawn(self._weight_sync(r, r.generation))
        self._spawn(self._stale_watch())
        try:
            while not ctx.stop.is_set():
                await self._wait_until(lambda: self._worth_leasing() or self._all_dead())
                if self._all_dead():
                    ctx.halt(f"every rollout replica died (last: {self._last_death}); see the log for each "
                             "replica's error")
                    return
                if ctx.stop.is_set():
                    return
                want = min(self.rows_per_lease,
                           self._free_slots(self.rows_per_lease + len(self._pending)) - len(self._pending))
                meta = await ctx.store.get_meta(self.name, self.consumes, want, partial=True,
                                                lease_s=self.lease_s, consumer=self.name)
                if meta.end_of_stream:
                    break
                batch = await ctx.store.get(meta)
                lease = _Lease(meta, len(meta))
                prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
                gids = batch[C.GROUP_ID].tolist()
                for i, row in enumerate(meta.row_ids.tolist()):
                    self._pending.append(_Req(row, lease, tuple(prompts[i].tolist()), int(gids[i])))
                self._dispatch()
                await asyncio.sleep(0)
            # stream ended: wait for what is in flight
            await self._wait_until(lambda: self._inflight_total == 0 and not self._pending)
            await self._flush()
        finally:
            for t in list(self._tasks):
                t.cancel()

    def _all_dead(self) -> bool:
        return all(r.dead and not r.reviving for r in self.replicas)

    def _next_replica(self, aside: list[tuple[int, int]]) -> Replica | None:
        """The eligible replica with the most free slots (lowest index on ties), or None; ineligible replicas
        with free slots are put ``aside`` (they go back after the dispatch)."""
        heap = self._by_free
        while heap:
            neg_free, idx = heap[0]
            r = self.replicas[idx]
            if neg_free != len(r.inflight) - self.max_inflight or neg_free >= 0 or r.dead:
                heapq.heappop(heap)  # stale, full or dead: a change of load (or a restart) pushes a new entry
            elif not self._eligible(r):
                aside.append(heapq.heappop(heap))
            else:
                return r
        return None

    def _dispatch(self) -> None:
        """Assign pending requests to eligible replicas (most free slots first), one generate call per replica."""
        if not self._pending:
            return
        per: dict[int, list[_Req]] = {}
        assigned = 0
        aside: list[tuple[int, int]] = []
        for req in self._pending:
            r = self._next_replica(aside)
            if r is None:
                break
            idx = r.index
            req.start_version = min(r.engine.version, min(req.prefix_versions, default=r.engine.version))
            r.inflight[req.request_id] = req
            self._load_changed(r)
            per.setdefault(idx, []).append(req)
            assigned += 1
        for entry in aside:
            heapq.heappush(self._by_free, entry)
        self._pending = self._pending[assigned:]
        self._inflight_total += assigned
        for idx, reqs in per.items():
            r = self.replicas[idx]
            self._mark_busy(r)
            self._spawn(self._drive(r, reqs))

    def _request(self, req: _Req) -> GenerationRequest:
        return GenerationRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt, sampling=self.sampling,
            prefix_token_ids=req.prefix_ids, prefix_logprobs=req.prefix_lps, prefix_versions=req.prefix_versions,
        )

    async def _drive(self, r: Replica, reqs: list[_Req]) -> None:
        waiting = {q.request_id: q for q in reqs}
        unknown: list[str] = []
        gen = r.generation
        try:
            async for res in r.engine.generate([self._request(q) for q in reqs]):
                if waiting.pop(res.request_id, None) is None:
                    unknown.append(res.request_id)
                await self._on_result(r, res)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a dying engine must not take the run down
            if r.generation == gen:  # not a late failure of an incarnation already replaced
                await self._replica_died(r, exc)
            return
        # the contract is one result per request: a request left without one would wait forever (a hang)
        orphans = [q for q in waiting.values() if r.inflight.get(q.request_id) is q]
        if orphans and not self.ctx.stop.is_set():
            why = (f"rollout engine {type(r.engine).__name__} (replica {r.index}) ended generate() without a result "
                   f"for this request" + (f"; it returned unknown request ids {unknown[:5]}" if unknown else "")
                   + ". Every request must yield exactly one result with its own request_id")
            for q in orphans:
                del r.inflight[q.request_id]
                self._load_changed(r)
                self._inflight_total -= 1
                self.ctx.fail_rows(self.name, [q.row], why)
                await self._write(q, None)
            self._mark_busy(r)
            self._dispatch()
            self._poke()

    async def _replica_died(self, r: Replica, exc: BaseException) -> None:
        if r.dead:
            return
        r.dead = True
        self._alive -= 1
        self._last_death = f"replica {r.index}: {type(exc).__name__}: {exc}"
        orphans = list(r.inflight.values())
        self._inflight_total -= len(orphans)
        r.inflight.clear()
        self._load_changed(r)
        self._mark_busy(r)
        self.ctx.counters["replicas_died"] += 1
        self.ctx.counters["requeued_engine_death"] += len(orphans)
        log.error("rollout replica %d died (%s: %s); re-queuing its %d requests", r.index, type(exc).__name__, exc,
                  len(orphans))
        for q in orphans:
            q.attempt += 1
            q.prefix_ids, q.prefix_lps, q.prefix_versions = (), (), ()
            self._pending.append(q)
        r.generation += 1
        if callable(getattr(r.engine, "restart", None)) and not self.ctx.stop.is_set():
            r.reviving = True  # the engine can be replaced (a launcher's remote replica): do it, then reload weights
            self._spawn(self._revive(r))
        self._dispatch()
        self._poke()
        await self.ctx.notify()  # its weight-sync task sees the death and ends

    async def _revive(self, r: Replica) -> None:
        """Replace a dead replica's engine, load the newest staged weights into it, and give it work again."""
        ctx = self.ctx
        while True:
            try:
                with ctx.timeline.span(r.lane, "restart"):
                    await r.engine.restart()  # type: ignore[attr-defined]
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - out of restarts (or cannot start): it stays dead
                r.reviving = False
                self._last_death = f"replica {r.index}: restart failed: {type(exc).__name__}: {exc}"
                log.error("rollout replica %d could not be restarted: %s: %s", r.index, type(exc).__name__, exc)
                self._poke()
                return
            try:
                if self.weights_pushed or ctx.published > r.engine.version:
                    with ctx.timeline.span(r.lane, "update_weights"):
                        await self._update(r, min_version=ctx.published)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the new engine failed too: replace it again (restart counts)
                log.error("rollout replica %d failed loading weights after its restart: %s: %s", r.index,
                          type(exc).__name__, exc)
        r.reviving = False
        r.dead = False
        self._load_changed(r)
        self._alive += 1
        ctx.counters["replicas_restarted"] += 1
        log.warning("rollout replica %d restarted at version %d", r.index, r.engine.version)
        self._spawn(self._weight_sync(r, r.generation))
        self._dispatch()
        self._poke()

    async def _on_result(self, r: Replica, res: GenerationResult) -> None:
        ctx = self.ctx
        req = r.inflight.pop(res.request_id, None)
        self._mark_busy(r)
        if req is None:
            return  # a request we already gave up on
        self._load_changed(r)
        self._inflight_total -= 1
        if res.finish_reason is FinishReason.ERROR:
            ctx.fail_rows(self.name, [req.row], res.error or "engine error")
            await self._write(req, None)
        elif res.finish_reason is FinishReason.ABORT:
            if ctx.stop.is_set():
                return
            self._resubmit(r, req, res)
        elif res.min_version is not None and S.must_abort(res.min_version, ctx.version, ctx.k):
            self._stale(req)
        else:
            await self._write(req, res)
        self._dispatch()
        self._poke()

    def _resubmit(self, r: Replica, req: _Req, res: GenerationResult) -> None:
        ctx = self.ctx
        fresh_prefix = res.min_version is None or not S.must_abort(res.min_version, ctx.version, ctx.k)
        if len(res.token_ids) and fresh_prefix and r.engine.features.supports_resume_prefix:
            req.prefix_ids = _as_tuple(res.token_ids)
            req.prefix_lps = _as_tuple(res.logprobs)
            req.prefix_versions = _as_tuple(res.versions)
            ctx.counters["resumed_partial"] += 1
            req.attempt += 1
            self._pending.append(req)
        elif not fresh_prefix:
            self._stale(req)
        else:
            req.prefix_ids, req.prefix_lps, req.prefix_versions = (), (), ()
            req.attempt += 1
            ctx.counters["restarted_abort"] += 1
            self._pending.append(req)

    def _stale(self, req: _Req) -> None:
        """A generation that can no longer be used: start it again on fresh weights (requeue) or drop its group."""
        ctx = self.ctx
        if ctx.stale_policy == "drop":
            ctx.outcomes.stale(req.row)
            self._spawn(self._write(req, None))
            return
        req.prefix_ids, req.prefix_lps, req.prefix_versions = (), (), ()
        req.attempt += 1
        ctx.counters["requeued_stale_rollout"] += 1
        self._pending.append(req)

    async def _write(self, req: _Req, res: GenerationResult | None) -> None:
        self._buffer.append((req, res))
        if len(self._buffer) >= 64:
            await self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(self.write_interval_s, lambda: self._spawn(self._flush()))

    async def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer:
            return
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
                vrange.append((self.ctx.version, self.ctx.version))
                continue
            ids.append(torch.as_tensor(res.token_ids, dtype=torch.int64))
            lps.append(torch.as_tensor(res.logprobs, dtype=torch.float32))
            # versions are stored at the width of the token ids: lengths-only (zero-width) ids of a simulated
            # engine get lengths-only versions (the row's version range is put beside them, below)
            v = torch.as_tensor(res.versions, dtype=torch.int64)
            vers.append(v if ids[-1].dim() == 1 else v.new_empty((v.shape[0], *ids[-1].shape[1:])))
            lengths.append(len(res.token_ids))
            lo = res.min_version if res.min_version is not None else self.ctx.version
            hi = res.max_version if res.max_version is not None else self.ctx.version
            vrange.append((lo, hi))
        lens = torch.tensor(lengths, dtype=torch.int64)
        cols = {
            C.RESPONSE_IDS: RaggedTensor.from_lengths(torch.cat(ids), lens),
            C.BEHAVIOR_LOGPROBS: RaggedTensor.from_lengths(torch.cat(lps), lens),
            C.RESPONSE_VERSIONS: RaggedTensor.from_lengths(torch.cat(vers), lens),
            C.TRUNCATED: torch.tensor(cut, dtype=torch.bool),
        }
        await self.ctx.store.put(cols, rows=BatchMeta(row_ids=rows), versions=torch.tensor(vrange))
        self.ctx.processed[self.name] += len(items)
        self.ctx.counters["tokens_generated"] += int(lens.sum())
        done: dict[int, _Lease] = {}
        for q, _ in items:
            q.lease.remaining -= 1
            if q.lease.remaining == 0:
                done[id(q.lease)] = q.lease
        for lease in done.values():
            await self.ctx.store.ack(lease.meta)
        self._poke()

    # -- weights and staleness -------------------------------------------------------------

    async def _weight_sync(self, r: Replica, gen: int) -> None:
        ctx = self.ctx
        if r.sync_generation == gen:
            return  # already running: a replica restarted before the stage ran gets its task from both places
        r.sync_generation = gen
        while not ctx.stop.is_set() and not r.dead and r.generation == gen:
            await ctx.wait_for(lambda: ctx.published > r.engine.version or r.dead or r.generation != gen)
            if ctx.stop.is_set() or r.dead or r.generation != gen:
                return
            try:
                with ctx.timeline.span(r.lane, "update_weights"):
                    await self._update(r)
            except EngineError as exc:
                # the engine died or missed the update's deadline: a replaceable replica gets the update again
                # after its restart; otherwise it is dead like any failed engine
                if r.generation == gen:
                    await self._replica_died(r, exc)
                return
            ctx.counters["weight_updates"] += 1
            self._dispatch()
            self._poke()
            await ctx.notify()  # waiters on a replica's version (the weights canary) look again

    async def _update(self, r: Replica, *, min_version: int | None = None) -> None:
        """Pull the newest staged version (``min_version``: default the replica's next) into replica ``r``."""
        ctx = self.ctx
        want = r.engine.version + 1 if min_version is None else min_version
        stream = self.transport.receive(min_version=want, deadline_s=self.deadline_s)
        first = await stream.__anext__()

        async def chain() -> AsyncIterator[WeightBucket]:
            yield first
            async for b in stream:
                yield b

        feats = r.engine.features
        if r.inflight and not feats.supports_inflight_weight_update and feats.supports_pause_abort:
            r.updating = True
            try:
                await r.engine.pause(PauseMode.ABORT)
                await r.engine.update_weights(first.version, chain(), kv_cache=self.kv_cache)
            finally:
                r.updating = False
                await r.engine.resume()
            ctx.counters["paused_for_update"] += 1
        else:
            await r.engine.update_weights(first.version, chain(), kv_cache=self.kv_cache)

    async def _stale_watch(self) -> None:
        """On every trainer version, abort in-flight requests that can no longer be used."""
        ctx = self.ctx
        seen = ctx.version
        while not ctx.stop.is_set():
            await ctx.wait_for(lambda: ctx.version != seen)
            seen = ctx.version
            for r in self.replicas:
                if r.dead or not r.engine.features.supports_abort:
                    continue
                ids = [rid for rid, q in r.inflight.items() if S.must_abort(q.start_version, seen, ctx.k)]
                if ids:
                    ctx.counters["aborted_stale"] += len(ids)
                    try:
                        await r.engine.abort(ids)
                    except Exception as exc:  # noqa: BLE001
                        await self._replica_died(r, exc)

    async def sleep_all(self) -> None:
        """Every replica releases its device memory for the colocated train step (all at once, like the devices)."""
        await asyncio.gather(*(r.engine.sleep(1) for r in self.replicas
                               if not r.dead and r.engine.features.supports_sleep))

    async def wake_all(self) -> None:
        await asyncio.gather(*(r.engine.wake_up() for r in self.replicas
                               if not r.dead and r.engine.features.supports_sleep))

    def close_spans(self) -> None:
        """Record the busy spans still open (replicas generating when the run stopped)."""
        if not hasattr(self, "ctx"):
            return  # the run stopped before the stage was bound (an engine failed to start)
        now = self.ctx.clock()
        for idx, since in list(self._busy_since.items()):
            self.ctx.timeline.add(self.replicas[idx].lane, "generate", since, now)
        self._busy_since.clear()


# ------------------------------------------------------------------------------------------- reward


class RewardStage(Stage):
    """Scores each completion with the reward plugin; a sample whose reward raises or times out is failed."""

    name = "reward"
    consumes = (C.PROMPT_IDS, C.RESPONSE_IDS, C.GROUP_ID)
    produces = (C.REWARD,)
    span_name = "score"

    def __init__(self, reward: Reward, tokenizer: Tokenizer, *, workers: int, timeout_s: float) -> None:
        self.reward = reward
        self.tokenizer = tokenizer
        self.concurrency = workers
        self.timeout_s = timeout_s
        self.needs_text = bool(getattr(reward, "needs_text", True))
        self.extra: Counter[str] = Counter()
        self.reward_name: str | None = None  #: the plugin's registered name, for error messages (set by the runtime)

    async def process(self, batch: Batch) -> StageOutput:
        ctx = self.ctx
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
        gids = batch[C.GROUP_ID].tolist()
        rows = batch.row_ids.tolist() if batch.row_ids is not None else list(range(batch.num_rows))
        out = torch.zeros(batch.num_rows, dtype=torch.float32)
        samples = []
        for i in range(batch.num_rows):
            info = ctx.ledger.groups.get(int(gids[i]))
            record = info.record if info is not None else None
            completion_ids = resp[i]
            samples.append(RewardInput(
                prompt=record.prompt if record else "",
                completion=self.tokenizer.decode(completion_ids.tolist()) if self.needs_text else "",
                prompt_token_ids=tuple(prompts[i].tolist()) if self.needs_text else (),
                completion_token_ids=tuple(completion_ids.tolist()) if self.needs_text else (),
                metadata=dict(record.metadata) if record else {},
            ))
        score_many = getattr(self.reward, "score_many", None)
        if callable(score_many):
            # a remote reward pool scores the whole batch in one round trip: (True, value) or (False, why) each
            answers = await score_many(samples, self.timeout_s)
        else:
            answers = [await self._score_one(sample) for sample in samples]
        for i, (ok, value) in enumerate(answers):
            try:
                if not ok:
                    raise _Failed(value)
                if isinstance(value, Mapping):
                    if "reward" not in value:
                        raise ValueError(f"reward {self._label()} returned a mapping without a 'reward' key "
                                         f"(keys: {sorted(map(str, value))}); return {{'reward': <number>, ...}}")
                    extra = {str(key): self._number(v, f"extra value {key!r}") for key, v in value.items()
                             if key != "reward"}
                    self.extra.update(extra)
                    if extra:
                        if len(ctx.reward_extra) >= 1 << 18:  # rows dropped before training never collect theirs
                            for old in sorted(ctx.reward_extra)[: 1 << 17]:
                                del ctx.reward_extra[old]
                        ctx.reward_extra[int(rows[i])] = extra
                    value = value["reward"]
                out[i] = self._number(value, "value")
            except Exception as exc:  # noqa: BLE001 - one sample's failure is recorded, the run goes on
                why = str(exc) if isinstance(exc, _Failed) else f"{type(exc).__name__}: {exc}"
                ctx.fail_rows(self.name, [rows[i]], why)
        return StageOutput({C.REWARD: out})

    async def _score_one(self, sample: RewardInput) -> tuple[bool, Any]:
        """``(True, value)``, or ``(False, why)`` when the reward raised or timed out."""
        try:
            value = self.reward.score(sample)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return True, value
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return False, f"timed out after {self.timeout_s}s"
        except Exception as exc:  # noqa: BLE001 - recorded on the sample by the caller
            return False, f"{type(exc).__name__}: {exc}"

    def _label(self) -> str:
        return repr(self.reward_name) if self.reward_name else type(self.reward).__name__

    def _number(self, value: Any, what: str) -> float:
        """``value`` as a float; anything but a finite real number fails the sample (a NaN would poison training)."""
        if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            number = float(value)
            if math.isfinite(number):
                return number
        raise ValueError(f"reward {self._label()} returned {what} {value!r}, not a finite number; "
                         "a reward must return a float (or a mapping with a float 'reward')")


class _Failed(Exception):
    """A reward that raised or timed out; the message is already the sample's recorded error."""


# ---------------------------------------------------------------------------------------- log-probs


class LogprobStage(Stage):
    """Log-probs of the responses under a train engine: the frozen reference (``ref``) or the proximal policy (``old``)."""

    span_name = "logprobs"
    consumes = (C.PROMPT_IDS, C.RESPONSE_IDS)

    def __init__(self, name: str, column: str | None, engine: TrainEngine, *, batch_size: int,
                 values: bool = False, lock: asyncio.Lock | None = None) -> None:
        self.lock = lock or asyncio.Lock()  #: shared with the train stage when ``engine`` is the trainer
        self.name = name
        self.column = column
        self.values = values
        self.produces = tuple(c for c in (column, C.VALUES if values else None) if c)
        self.engine = engine
        self.batch_size = batch_size

    async def process(self, batch: Batch) -> StageOutput:
        async with self.lock:  # a TrainEngine runs one call at a time
            out = await self.engine.compute_logprobs(batch.project([C.PROMPT_IDS, C.RESPONSE_IDS]),
                                                     values=self.values)
        cols = {self.column: out[C.LOGPROBS]} if self.column else {}
        if self.values:
            cols[C.VALUES] = out[C.VALUES]
        return StageOutput(cols)


# ---------------------------------------------------------------------------------------- advantage


class AdvantageStage(Stage):
    """Group-relative (or any algorithm's) advantages over whole prompt groups (the group sampler)."""

    name = "advantage"
    produces = (C.ADVANTAGES,)
    sampler = "group"
    span_name = "advantages"

    def __init__(self, algorithm: Algorithm, consumes: Sequence[str], *, n: int, groups_per_lease: int) -> None:
        self.algorithm = algorithm
        self.consumes = tuple(dict.fromkeys([C.RESPONSE_IDS, C.GROUP_ID, *consumes]))
        self.batch_size = n * groups_per_lease

    def placeholder(self, batch: Batch) -> dict[str, Any]:
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        return {C.ADVANTAGES: RaggedTensor(torch.zeros(resp.numel_packed, dtype=torch.float32), resp.offsets)}

    async def handle(self, meta: BatchMeta, batch: Batch) -> None:
        # a group with a failed row is skipped whole (the trainer drops it); others get advantages
        ctx = self.ctx
        good = (~ctx.outcomes.group_mask(meta.row_ids, batch[C.GROUP_ID])).nonzero().squeeze(1)
        out = self.placeholder(batch)
        if good.numel():
            sub = batch if good.numel() == batch.num_rows else batch.select(good)
            result = self.algorithm.compute_advantages(sub)
            adv = result[C.ADVANTAGES]
            if C.FILTERED in result.columns:
                # dynamic sampling: the algorithm filters these samples out; the trainer drops their groups
                ctx.outcomes.filter(self.name, meta.row_ids[good][result[C.FILTERED].to(torch.bool).reshape(-1)])
            out = merge_outputs(batch, good, {C.ADVANTAGES: adv}, out)
        ctx.processed[self.name] += int(good.numel())
        await ctx.store.put(out, rows=meta)


# -------------------------------------------------------------------------------------------- train


class TrainStage(Stage):
    """Takes B fresh prompt groups per step, trains, publishes weights; stale and failed groups settle here.

    After each step it stages the new weights and announces :class:`~asyncflow_core.flow.events.VersionPublished`;
    weight sync, the canary, the step's metrics and checkpoints follow that event (flow/events.py).
    """

    name = "train"
    sampler = "group"
    span_name = "train_step"

    def __init__(
        self, engine: TrainEngine, algorithm: Algorithm, transport: WeightTransport, rollout: RolloutStage | None, *,
        consumes: Sequence[str], total_steps: int, bucket_bytes: int, deadline_s: float, colocated: bool,
    ) -> None:
        self.engine = engine
        self.algorithm = algorithm
        self.transport = transport
        self.rollout = rollout
        self.consumes = tuple(dict.fromkeys([C.PROMPT_IDS, C.RESPONSE_IDS, C.GROUP_ID, C.ADVANTAGES, *consumes]))
        self.total_steps = total_steps
        self.bucket_bytes = bucket_bytes
        self.deadline_s = deadline_s
        self.colocated = colocated
        self.engine_lock = asyncio.Lock()  #: held for every trainer call (shared with the `old` log-prob stage)
        self.staleness_hist: Counter[int] = Counter()
        self.canary: Any = None  #: a :class:`~asyncflow_core.flow.canary.Canary` checking the replicas' weights, or None

    async def run(self) -> None:
        ctx = self.ctx
        B, n = ctx.prompts_per_step, ctx.n
        while not ctx.stop.is_set() and self.engine.version < self.total_steps:
            v = self.engine.version
            t_begin = ctx.clock()
            parts: list[Batch] = []
            leases: list[BatchMeta] = []
            lags: list[torch.Tensor] = []
            have = 0
            ended = False
            with ctx.timeline.span(self.name, "wait_batch"):
                while have < B:
                    meta = await ctx.store.get_meta(self.name, self.consumes, (B - have) * n, sampler=self.sampler,
                                                    partial=True, consumer=self.name, lease_s=self.lease_s)
                    if meta.end_of_stream:
                        ended = True
                        break
                    leases.append(meta)
                    batch = await ctx.store.get(meta)
                    keep = self._settle(v, meta, batch)
                    if keep.numel() < batch.num_rows:
                        await ctx.notify()  # re-queued or dropped groups: the feeder may start prompts now
                    if keep.numel():
                        parts.append(batch if keep.numel() == batch.num_rows else batch.select(keep))
                        lags.append(v - meta.min_version[keep])
                        have += int(torch.unique(batch[C.GROUP_ID][keep]).numel())
            if ended and have < B:
                # fewer than B groups will ever come: release them (they stay unfinished in the ledger)
                for m in leases:
                    await ctx.store.release(m)
                ctx.halt(f"the prompt stream ended before step {v} could gather {B} prompt groups")
                break
            train_batch = Batch.cat(parts) if len(parts) > 1 else parts[0]
            # the staleness invariant, checked on the exact rows trained on
            lag = torch.cat(lags)
            if bool((lag > ctx.k).any()):
                raise AssertionError(f"staleness violated: lag {int(lag.max())} > k={ctx.k} at step {v}")
            self.staleness_hist.update(lag.tolist())
            if self.canary is not None:  # its check of version v must finish while the trainer still holds v
                with ctx.timeline.span(self.name, "canary"):
                    await self.canary.before_step(v)
            if self.colocated and self.rollout is not None:
                with ctx.timeline.span(self.name, "sleep"):
                    await self.rollout.sleep_all()
            if getattr(self.algorithm, "advantage_scope", "group") == "step":
                # batch-normalised advantages (and PPO's returns) need the whole step's rows at once
                train_batch = self.algorithm.compute_advantages(train_batch)
            with ctx.timeline.span(self.name, "train_step"):
                async with self.engine_lock:
                    try:
                        metrics = await self.engine.train_step(train_batch, self.algorithm)
                    except AsyncflowError:
                        raise
                    except Exception as exc:  # one line for the CLI, the original kept as the cause
                        raise EngineError(
                            f"train engine {type(self.engine).__name__} failed on step {v} "
                            f"({train_batch.num_rows} samples): {type(exc).__name__}: {exc}. Check that the rollout "
                            "and train engines share a vocabulary and model, and what the engine's error names"
                        ) from exc
            for m in leases:
                await ctx.store.ack(m)
            for g in torch.unique(train_batch[C.GROUP_ID]).tolist():
                ctx.ledger.mark_trained(int(g))
            with ctx.timeline.span(self.name, "send_weights"):
                async with self.engine_lock:
                    report = await self.transport.send(self.engine.export_weights(bucket_bytes=self.bucket_bytes),
                                                       deadline_s=self.deadline_s)
            ctx.version = self.engine.version
            ctx.published = report.version
            if self.colocated and self.rollout is not None:
                with ctx.timeline.span(self.name, "wake"):
                    await self.rollout.wake_all()
            await ctx.events.publish(VersionPublished(self.engine.version, report.version, v, train_batch, metrics,
                                                      report, lag, t_begin))
        if self.engine.version >= self.total_steps:
            ctx.halt("done")

    def _settle(self, v: int, meta: BatchMeta, batch: Batch) -> torch.Tensor:
        """Positions of ``batch`` to train on. Groups with a marked row are dropped (failed > filtered > stale);
        groups outside the staleness bound are re-queued or dropped per the policy."""
        ctx = self.ctx
        gids = batch[C.GROUP_ID]
        reasons = ctx.outcomes.group_reasons(meta.row_ids, gids)
        for g, why in reasons.items():
            ctx.ledger.mark_dropped(int(g), why)
        settled = torch.isin(gids, torch.tensor(list(reasons), dtype=gids.dtype))
        fresh, stale = S.split_fresh_groups(v, ctx.k, gids, meta.min_version)
        fresh = fresh & ~settled
        stale = stale & ~settled
        for g in torch.unique(gids[stale]).tolist():
            if ctx.stale_policy == "drop":
                ctx.ledger.mark_dropped(int(g), RowOutcome.STALE)
            else:
                ctx.ledger.mark_requeued(int(g), RowOutcome.STALE)
        return fresh.nonzero().squeeze(1)
