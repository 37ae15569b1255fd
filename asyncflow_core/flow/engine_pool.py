"""A pool of engine replicas: their state, their load, death and restart, sleep/wake and abort-by-id.

The pool knows nothing about prompts, weights or versions. It holds, per
replica, a :class:`ReplicaState`, the requests in flight (keyed by request
id, values opaque to the pool) and an incarnation counter; the run-wide
counts (:attr:`EnginePool.alive`, :attr:`EnginePool.inflight_total`) follow
from those and are kept by the pool's own mutators only, so no caller
adjusts a counter by hand. Whether a replica may start work beyond that
(its weights inside the staleness bound, say) is the ``may_start``
predicate its owner passes in. The rollout stage uses it for generation
engines; the ``model`` reward uses it for its replicas (judge engines, and
classifier copies with one batch in flight each), named in log lines by
``name``.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("asyncflow.flow")


class ReplicaState(enum.Enum):
    """Where a replica is in its life. Only :attr:`READY` replicas get new work."""

    READY = "ready"  #: serving
    UPDATING = "updating"  #: paused for a weight update (its in-flight requests were aborted)
    DEAD = "dead"  #: failed, and not being restarted (out of restarts, or not restartable)
    REVIVING = "reviving"  #: failed, and its engine is being restarted


#: States whose replica counts as alive (it serves now, or will once its update ends).
_ALIVE = frozenset({ReplicaState.READY, ReplicaState.UPDATING})


@dataclass
class Replica:
    """One engine replica. Its state and load change only through :class:`EnginePool`."""

    index: int
    engine: Any
    inflight: dict[str, Any] = field(default_factory=dict)  #: request id -> the owner's request
    state: ReplicaState = ReplicaState.READY
    generation: int = 0  #: +1 per death: work started for an earlier incarnation must not touch this one
    sync_generation: int = -1  #: the incarnation whose weight-follow task is running (one task per incarnation)
    asleep: bool = False  #: released its device memory (colocated); its state is unchanged, as is dispatch

    @property
    def dead(self) -> bool:
        """Failed (restarting or not): no work, no weight updates."""
        return self.state in (ReplicaState.DEAD, ReplicaState.REVIVING)

    @property
    def reviving(self) -> bool:
        return self.state is ReplicaState.REVIVING

    @property
    def updating(self) -> bool:
        return self.state is ReplicaState.UPDATING

    @property
    def lane(self) -> str:
        return f"rollout/{self.index}"


class EnginePool:
    """Replicas with ``max_inflight`` slots each; the free-slot heap picks the replica with the most free slots."""

    def __init__(self, engines: list[Any], *, max_inflight: int,
                 may_start: Callable[[Replica], bool] | None = None, name: str = "rollout") -> None:
        self.replicas = [Replica(i, e) for i, e in enumerate(engines)]
        self.name = name  #: what the replicas are, in log lines ("rollout", "judge", "reward model")
        self.max_inflight = max_inflight
        #: beyond state and load, whether a replica may start work now (the owner's policy, e.g. staleness)
        self.may_start: Callable[[Replica], bool] = may_start or (lambda r: True)
        self.last_death: str | None = None  #: the error of the replica that died last, for a stop message
        self._alive = len(self.replicas)
        self._inflight_total = 0
        # (in flight - max_inflight, index) per replica, most free slots first: pushed whenever a replica's load
        # changes, so a dispatch pops the few replicas it assigns to instead of sorting every replica (entries
        # that no longer match the replica's load are skipped)
        self._by_free = [(-max_inflight, i) for i in range(len(self.replicas))]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    # -- counts (kept by the mutators below) -------------------------------------------------------------

    @property
    def alive(self) -> int:
        """Replicas that are ready or updating."""
        return self._alive

    @property
    def inflight_total(self) -> int:
        """Requests in flight over every replica."""
        return self._inflight_total

    def all_dead(self) -> bool:
        """Every replica is dead for good (none serving, none being restarted)."""
        return all(r.state is ReplicaState.DEAD for r in self.replicas)

    def _set_state(self, r: Replica, state: ReplicaState) -> None:
        self._alive += (state in _ALIVE) - (r.state in _ALIVE)
        r.state = state

    # -- slots ------------------------------------------------------------------------------------

    def eligible(self, r: Replica) -> bool:
        return (r.state is ReplicaState.READY and len(r.inflight) < self.max_inflight and self.may_start(r))

    def free_slots(self, enough: int | None = None) -> int:
        """Free slots of eligible replicas (counting stops once ``enough`` are found)."""
        total = 0
        for r in self.replicas:
            if self.eligible(r):
                total += self.max_inflight - len(r.inflight)
                if enough is not None and total >= enough:
                    break
        return total

    def _load_changed(self, r: Replica) -> None:
        heapq.heappush(self._by_free, (len(r.inflight) - self.max_inflight, r.index))
        if len(self._by_free) > 4 * len(self.replicas) + 1024:  # drop stale entries
            self._by_free = [(len(q.inflight) - self.max_inflight, q.index) for q in self.replicas]
            heapq.heapify(self._by_free)

    def next_replica(self, aside: list[tuple[int, int]],
                     accept: Callable[[Replica], bool] | None = None) -> Replica | None:
        """The eligible replica with the most free slots (lowest index on ties) that ``accept`` takes (default:
        any), or None; the others with free slots are put ``aside`` (hand them to :meth:`put_back` after the
        dispatch)."""
        heap = self._by_free
        while heap:
            neg_free, idx = heap[0]
            r = self.replicas[idx]
            if neg_free != len(r.inflight) - self.max_inflight or neg_free >= 0 or r.dead:
                heapq.heappop(heap)  # stale, full or dead: a change of load (or a restart) pushes a new entry
            elif not self.eligible(r) or (accept is not None and not accept(r)):
                aside.append(heapq.heappop(heap))
            else:
                return r
        return None

    def put_back(self, aside: list[tuple[int, int]]) -> None:
        for entry in aside:
            heapq.heappush(self._by_free, entry)

    def assign(self, r: Replica, request_id: str, request: Any) -> None:
        """Count ``request`` in flight on ``r``."""
        r.inflight[request_id] = request
        self._inflight_total += 1
        self._load_changed(r)

    def release(self, r: Replica, request_id: str) -> Any | None:
        """Take request ``request_id`` off ``r`` (its result came, or it was given up); None if not in flight."""
        req = r.inflight.pop(request_id, None)
        if req is not None:
            self._inflight_total -= 1
            self._load_changed(r)
        return req

    # -- life -------------------------------------------------------------------------------------

    def mark_dead(self, r: Replica, exc: BaseException, *, restartable: bool) -> list[Any] | None:
        """Record ``r``'s death; returns its orphaned requests (None when it was already dead).

        A ``restartable`` replica goes to :attr:`ReplicaState.REVIVING`: call :meth:`restart` next.
        """
        if r.dead:
            return None
        self.last_death = f"replica {r.index}: {type(exc).__name__}: {exc}"
        orphans = list(r.inflight.values())
        self._inflight_total -= len(orphans)
        r.inflight.clear()
        self._load_changed(r)
        r.generation += 1
        self._set_state(r, ReplicaState.REVIVING if restartable else ReplicaState.DEAD)
        return orphans

    @staticmethod
    def restartable(r: Replica) -> bool:
        """The engine declares ``supports_restart`` (a launcher's remote replica that can be rebuilt)."""
        return bool(getattr(r.engine.features, "supports_restart", False))

    async def restart(self, r: Replica, reload: Callable[[Replica], Awaitable[None]], *,
                      span: Callable[[str, str], Any]) -> bool:
        """Restart a reviving replica's engine and ``reload`` it (weights); True once it is ready again.

        A failed restart leaves it dead for good (False); a failed ``reload`` restarts it again (the engine
        counts its restarts and gives up). ``span(lane, name)`` is the telemetry span of the restart.
        """
        while True:
            try:
                with span(r.lane, "restart"):
                    await r.engine.restart()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - out of restarts (or cannot start): it stays dead
                self._set_state(r, ReplicaState.DEAD)
                self.last_death = f"replica {r.index}: restart failed: {type(exc).__name__}: {exc}"
                log.error("%s replica %d could not be restarted: %s: %s", self.name, r.index, type(exc).__name__,
                          exc)
                return False
            try:
                await reload(r)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the new engine failed too: replace it again (restart counts)
                log.error("%s replica %d failed loading weights after its restart: %s: %s", self.name, r.index,
                          type(exc).__name__, exc)
        self._set_state(r, ReplicaState.READY)
        self._load_changed(r)
        return True

    def begin_update(self, r: Replica) -> None:
        """``r`` pauses for a weight update: no new work until :meth:`end_update`."""
        if r.state is ReplicaState.READY:
            self._set_state(r, ReplicaState.UPDATING)

    def end_update(self, r: Replica) -> None:
        if r.state is ReplicaState.UPDATING:  # a replica that died meanwhile stays dead
            self._set_state(r, ReplicaState.READY)

    # -- engine calls over the pool ------------------------------------------------------------------

    async def abort(self, r: Replica, request_ids: list[str]) -> bool:
        """Ask ``r``'s engine to abort ``request_ids`` (their results come back as aborted); False if it cannot."""
        if r.dead or not request_ids or not r.engine.features.supports_abort:
            return False
        await r.engine.abort(request_ids)
        return True

    async def sleep_all(self) -> None:
        """Every live replica that can releases its device memory (all at once, like the devices)."""
        todo = [r for r in self.replicas if not r.dead and r.engine.features.supports_sleep]
        await asyncio.gather(*(r.engine.sleep(1) for r in todo))
        for r in todo:
            r.asleep = True

    async def wake_all(self) -> None:
        todo = [r for r in self.replicas if not r.dead and r.engine.features.supports_sleep]
        await asyncio.gather(*(r.engine.wake_up() for r in todo))
        for r in self.replicas:
            r.asleep = False
