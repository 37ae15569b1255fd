"""The rollout stage: leases prompt rows, runs them on an engine pool, writes completions as they finish.

It is a composition of parts with one job each:

- ``EnginePool`` (flow/engine_pool.py): replica states, load, death and restart, sleep/wake, abort-by-id;
- ``StalenessGuard`` (flow/staleness.py): which replica may start, which generations are unusable;
- ``WeightFollower`` (flow/weight_follower.py): weight loads per replica, with pause/abort if needed;
- ``TrajectoryWriter`` (flow/trajectory_writer.py): the rollout columns, written in batches, and acks;
- an episode factory (flow/episode.py): what a row's requests are and what a finished one means
  (single-turn by default; multi-turn with an environment; captured with an agent);
- ``EpisodeDriving`` (flow/rollout_episodes.py, a mixin): resume, retry and requeue of a request that cannot
  be written, and each episode's environment (or agent) calls as tasks of their own.

The stage itself keeps the leasing, the dispatch of requests to replicas,
the handling of each result (one per request: write, resume, re-queue or
fail; for an episode, its environment step as a task of its own, so a slow
tool never holds dispatch or other episodes' decoding), and the busy-span
telemetry.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from asyncflow_core import columns as C
from asyncflow_core.flow.engine_pool import EnginePool, Replica
from asyncflow_core.flow.prompts import row_prompts
from asyncflow_core.flow.episode import EpisodeFactory, SingleTurn, SingleTurnEpisodes
from asyncflow_core.flow.rollout_episodes import EpisodeDriving
from asyncflow_core.flow.rollout_eval import EvalDispatch, EvalSlot
from asyncflow_core.flow.stage import Stage, unless
from asyncflow_core.flow.rollout_tail import TailHandling
from asyncflow_core.flow.staleness import REQUEST_START, StalenessGuard
from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT, TrajectoryWriter
from asyncflow_core.flow.weight_follower import WeightFollower
from asyncflow_core.interfaces import KVCachePolicy, RolloutEngine, WeightTransport
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store.lease import LeaseKeeper
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, RaggedTensor, SamplingParams

log = logging.getLogger("asyncflow.flow")

__all__ = ["ROLLOUT_OUT", "Replica", "RolloutStage"]


@dataclass
class _Lease:
    meta: BatchMeta
    remaining: int
    keeper: LeaseKeeper | None = None  #: renews the lease while its rows' episodes run (EpisodeDriving._keep_lease)


#: the single-turn episode (the request type of this stage before episodes)
_Req = SingleTurn


class RolloutStage(TailHandling, EpisodeDriving, EvalDispatch, Stage):
    """Dispatches prompt rows to engine replicas, writes completions row by row as they finish.

    One dispatcher leases rows (up to the replicas' free slots) and assigns
    each to the eligible replica with the most free slots; a replica is
    eligible when ready, not full, and its weights are inside the bound
    (:meth:`StalenessGuard.may_start`). Per replica the weight follower pulls
    each published version from the transport and applies it at a safe
    point, and the aborted requests are re-submitted with their tokens as a
    prefix when the engine can resume.

    ``episodes`` makes each leased row's episode (default: single-turn, one
    request per row). A multi-turn episode goes through the same dispatch
    once per turn; between turns it waits on its environment in a task of its
    own, holding no replica slot.
    """

    name = "rollout"
    consumes = (C.PROMPT_IDS, C.GROUP_ID)
    produces = ROLLOUT_OUT

    def __init__(
        self, replicas: list[RolloutEngine], transport: WeightTransport, sampling: SamplingParams, *,
        max_inflight: int, rows_per_lease: int, lease_s: float, write_interval_s: float, deadline_s: float,
        kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE, episodes: EpisodeFactory | None = None,
    ) -> None:
        self.episodes = episodes if episodes is not None else SingleTurnEpisodes()
        self.produces = tuple(self.episodes.columns)
        self.pool = EnginePool(replicas, max_inflight=max_inflight,
                               may_start=lambda r: self.guard.may_start(r.engine.version))
        self.follower = WeightFollower(transport, self.pool, deadline_s=deadline_s, kv_cache=kv_cache)
        self.guard: StalenessGuard  # set by bind (it reads the run's version and bound)
        self.transport = transport
        self.sampling = sampling
        self.max_inflight = max_inflight
        self.rows_per_lease = rows_per_lease
        self.lease_s = lease_s
        self.write_interval_s = write_interval_s
        self.deadline_s = deadline_s
        self.kv_cache = kv_cache
        self._pending: list[SingleTurn] = []
        self._in_env = 0  #: episodes waiting on their environment (reset or step): no slot, not pending
        self._open: set[Any] = set()  #: episodes whose environment is open (closed when the run stops)
        self.writer = TrajectoryWriter(self.name, interval_s=write_interval_s, spawn=self._spawn,
                                       on_written=self._poke, columns=self.produces)
        self._tasks: set[asyncio.Task] = set()
        self._closing: set[asyncio.Task] = set()  #: episodes' close() calls (awaited, not cancelled, at the end)
        self._busy_since: dict[int, float] = {}
        self._wake = asyncio.Event()  # dispatcher wake-up: slots freed, weights updated, version moved
        self.weights_pushed = False  #: a version is staged in the transport (a restarted replica must load it)

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    def bind(self, ctx: Any) -> None:
        super().bind(ctx)
        self.guard = StalenessGuard(ctx)
        self.writer.ctx = ctx

    def _poke(self) -> None:
        self._wake.set()

    async def _wait_until(self, predicate: Any) -> None:
        """Dispatcher wait; woken by its own events (per result) rather than the run-wide condition."""
        while not predicate() and not self.ctx.stop.is_set():
            self._wake.clear()
            await self._wake.wait()

    # -- helpers -----------------------------------------------------------------------

    def _worth_leasing(self) -> bool:
        """Cheap test first (counts, O(1) per wake-up), the exact count only when it may pass."""
        pool = self.pool
        upper = pool.alive * self.max_inflight - pool.inflight_total - len(self._pending)
        want = min(self.rows_per_lease, max(1, pool.alive * self.max_inflight // 8))
        return upper >= want and pool.free_slots(want + len(self._pending)) - len(self._pending) >= want

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

    def _follow(self, r: Replica) -> None:
        self._spawn(self.follower.follow(r, r.generation, self.ctx, on_failed=self.replica_died,
                                         on_updated=self._weights_updated))

    async def _weights_updated(self, r: Replica) -> None:
        await self._eval_weights_moved()
        self._dispatch()
        self._poke()
        await self.ctx.notify(r.index)  # waiters on a replica's version (the weights canary) look again

    # -- dispatch ------------------------------------------------------------------------

    async def run(self) -> None:
        ctx = self.ctx
        ctx.listeners.append(self._wake)
        # an evaluation's hold on a replica's weights can lift with no notify naming that replica (another replica
        # took the round's last request): only then does every notify look at every replica's weight-follow task
        self.follower.hold = self._eval_hold if self.eval is not None else None
        for r in self.replicas:
            self._follow(r)
        self._spawn(self._stale_watch())
        try:
            while not ctx.stop.is_set():
                await self._wait_until(lambda: self._worth_leasing() or self.pool.all_dead())
                if self.pool.all_dead():
                    ctx.halt(f"every rollout replica died (last: {self.pool.last_death}); see the log for each "
                             "replica's error")
                    return
                if ctx.stop.is_set():
                    return
                want = min(self.rows_per_lease,
                           self.pool.free_slots(self.rows_per_lease + len(self._pending)) - len(self._pending))
                # the dead replicas' requests wait here, not in the store, and count against the feeder's admission
                # bound: with every replica dead no row would ever come, so the lease also ends on that
                meta = await unless(ctx.store.get_meta(self.name, self.consumes, want, partial=True,
                                                       lease_s=self.lease_s, consumer=self.name),
                                    self._wait_until(self.pool.all_dead))
                if meta is None:
                    continue  # every replica died (or the run stopped) while no row was leasable: see the loop's head
                if meta.end_of_stream:
                    break
                batch = await ctx.store.get(meta)
                lease = _Lease(meta, len(meta), LeaseKeeper(ctx.store, meta, self.lease_s, clock=ctx.clock))
                prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
                gids = batch[C.GROUP_ID].tolist()
                for i, (row, prompt) in enumerate(zip(meta.row_ids.tolist(), row_prompts(prompts, gids))):
                    ep = self.episodes.new(row, lease, prompt, int(gids[i]), ctx)
                    if ep.multi_turn:
                        self._begin(ep)
                    else:
                        self._pending.append(ep)
                self._dispatch()
                await asyncio.sleep(0)
            # stream ended: wait for what is in flight
            await self._wait_until(lambda: self.pool.inflight_total == 0 and not self._pending and not self._in_env)
            await self.writer.flush()
        finally:
            closing = [t for t in self._tasks if t in self._closing]  # finished episodes' closes: let them finish
            for t in list(self._tasks):
                if t not in self._closing:
                    t.cancel()
            if self._open:  # environments of episodes cut short by the stop
                closing += [asyncio.ensure_future(ep.close()) for ep in list(self._open)]
                self._open.clear()
            await asyncio.gather(*closing, return_exceptions=True)

    def _dispatch(self) -> None:
        """Assign pending requests to eligible replicas (most free slots first), one generate call per replica."""
        self._dispatch_eval()  # evaluations first, within their share of each replica's slots
        if not self._pending:
            return
        if self.episodes.multi_turn:  # an episode whose earlier turns fell out of the bound while it waited
            stale = [q for q in self._pending if self.guard.unusable(q.oldest_version())]
            if stale:
                self._pending = [q for q in self._pending if not self.guard.unusable(q.oldest_version())]
                for q in stale:
                    self._stale(q)
                if not self._pending:
                    return
        per: dict[int, list[SingleTurn]] = {}
        taken = 0  # pending requests assigned or held
        aside: list[tuple[int, int]] = []
        # with async.start_on_step_weights a prompt waits for weights its step can use (the ledger's floor)
        floor_of = self.ctx.ledger.start_floor if self.guard.tail.step_weights else None
        lowest = self.ctx.version - self.ctx.k  # weights every eligible replica has (StalenessGuard.may_start)
        refused: int | None = None  # lowest floor no replica had in this dispatch: prompts at or above it wait
        held: list[SingleTurn] = []  # prompts whose step needs newer weights than a free replica has
        for req in self._pending:
            floor = lowest if floor_of is None else floor_of(req.group)
            if refused is not None and floor >= refused:
                r = None
            elif floor <= lowest:
                r = self.pool.next_replica(aside)
            else:
                r = self.pool.next_replica(aside, lambda q: q.engine.version >= floor)
            if r is None:
                if floor <= lowest:
                    break  # no free replica at all
                held.append(req)
                taken += 1
                if refused is None or floor < refused:
                    refused = floor
                    self.pool.put_back(aside)  # the replicas it set aside may take an older prompt's floor
                    aside.clear()
                continue
            req.start_version = self.guard.start_version(r.engine.version, req.held_versions())
            if req.origin_version is None and self.guard.tail.basis == REQUEST_START:
                # its age counts from here, across resumes (an episode's: across its turns, flow/multi_turn.py)
                req.origin_version = req.start_version
            self.pool.assign(r, req.request_id, req)
            per.setdefault(r.index, []).append(req)
            taken += 1
        self.pool.put_back(aside)
        self._pending = held + self._pending[taken:]
        for idx, reqs in per.items():
            r = self.replicas[idx]
            self._mark_busy(r)
            self._send(r, reqs)

    def _request(self, req: SingleTurn) -> GenerationRequest:
        return req.request(self.sampling)

    async def _drive(self, r: Replica, reqs: list[SingleTurn]) -> None:
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
                await self.replica_died(r, exc)
            return
        # the contract is one result per request: a request left without one would wait forever (a hang)
        orphans = [q for q in waiting.values() if r.inflight.get(q.request_id) is q]
        if orphans and not self.ctx.stop.is_set():
            why = (f"rollout engine {type(r.engine).__name__} (replica {r.index}) ended generate() without a result "
                   f"for this request" + (f"; it returned unknown request ids {unknown[:5]}" if unknown else "")
                   + ". Every request must yield exactly one result with its own request_id")
            for q in orphans:
                self.pool.release(r, q.request_id)
                self.ctx.fail_rows(self.name, [q.row], why)
                await self._settle(q, None)
            self._mark_busy(r)
            self._dispatch()
            self._poke()

    # -- replicas and weights (public: the runtime's initial push and resume use them) ------------------

    async def load_weights(self, r: Replica, *, min_version: int | None = None) -> None:
        """Pull the newest staged version (``min_version``: default the replica's next) into replica ``r``."""
        if await self.follower.load(r, min_version=min_version):
            self.ctx.counters["paused_for_update"] += 1

    async def replica_died(self, r: Replica, exc: BaseException) -> None:
        """Replica ``r`` failed: re-queue its requests, and restart it when its engine can be replaced."""
        orphans = self.pool.mark_dead(r, exc, restartable=self.pool.restartable(r) and not self.ctx.stop.is_set())
        if orphans is None:
            return  # already dead
        self._mark_busy(r)
        self.ctx.counters["replicas_died"] += 1
        self.ctx.counters["requeued_engine_death"] += sum(not isinstance(q, EvalSlot) for q in orphans)
        log.error("rollout replica %d died (%s: %s); re-queuing its %d requests", r.index, type(exc).__name__, exc,
                  len(orphans))
        for q in orphans:
            if isinstance(q, EvalSlot):
                continue  # the eval queue takes those back below
            q.retry_turn()  # an episode re-runs only the turn it was sampling (its environment is untouched)
            self._pending.append(q)
        await self._eval_replica_died(r)
        if r.reviving:  # the engine can be replaced (a launcher's remote replica): do it, then reload weights
            self._spawn(self._revive(r))
        self._dispatch()
        self._poke()
        await self.ctx.notify()  # its weight-follow task sees the death and ends

    async def _revive(self, r: Replica) -> None:
        """Replace a dead replica's engine, load the newest staged weights into it, and give it work again."""
        ctx = self.ctx

        async def reload(r: Replica) -> None:
            if self.follower.needs_reload(r.engine.version, ctx.published, pushed=self.weights_pushed):
                with ctx.timeline.span(r.lane, "update_weights"):
                    await self.load_weights(r, min_version=ctx.published)

        if not await self.pool.restart(r, reload, span=ctx.timeline.span):
            self._poke()
            return
        ctx.counters["replicas_restarted"] += 1
        log.warning("rollout replica %d restarted at version %d", r.index, r.engine.version)
        self._follow(r)
        self._dispatch()
        self._poke()

    # -- results -------------------------------------------------------------------------------

    async def _on_result(self, r: Replica, res: GenerationResult) -> None:
        ctx = self.ctx
        req = self.pool.release(r, res.request_id)
        self._mark_busy(r)
        if req is None:
            return  # a request we already gave up on
        if res.finish_reason is FinishReason.ERROR:
            ctx.fail_rows(self.name, [req.row], res.error or "engine error")
            await self._settle(req, None)
        elif res.finish_reason is FinishReason.ABORT:
            if ctx.stop.is_set():
                return
            self._resubmit(r, req, res)
        elif self._unusable(req, res):  # an episode: its oldest token over every turn
            self._stale(req, res)
        elif req.multi_turn:
            req.take_turn(res)
            self._in_env += 1
            self._spawn(self._step(req))
        else:
            await self.writer.write(req, res)
        self._dispatch()
        self._poke()

    # -- colocated sleep/wake and telemetry -------------------------------------------------------------

    async def sleep_all(self) -> None:
        """Every replica releases its device memory for the colocated train step (all at once, like the devices)."""
        await self.pool.sleep_all()

    async def wake_all(self) -> None:
        await self.pool.wake_all()

    def close_spans(self) -> None:
        """Record the busy spans still open (replicas generating when the run stopped)."""
        if not hasattr(self, "ctx"):
            return  # the run stopped before the stage was bound (an engine failed to start)
        now = self.ctx.clock()
        for idx, since in list(self._busy_since.items()):
            self.ctx.timeline.add(self.replicas[idx].lane, "generate", since, now)
        self._busy_since.clear()

