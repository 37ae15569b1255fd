"""A shared host for sim engines: processor sharing of one machine's cores on the loop's clock.

Off by default: every sim engine models its own accelerators, and its busy
periods cost their modelled seconds whatever else runs. When engines name
the same host (``machine: {name, capacity, demand, efficiency}`` in their
options), their busy periods share it. An activity is a quantity of *work*
(modelled seconds it would take alone) whose remaining work progresses at
the rate

    rate_i = min(1, eff x capacity / D) / min(1, capacity / demand_i)

where ``D`` is the sum of the demands (cores) of every activity active on the
host now, and ``eff`` is ``efficiency`` when the host is contended (two
activities or more, ``D > capacity``), else 1. Alone (``D = demand_i``) the rate is 1, so the
fitted costs keep their meaning. An engine that alone keeps more than the
host busy (``demand > capacity``, e.g. torch using every core) gets a share
of the host proportional to its demand; ``efficiency`` < 1 is the throughput
a contended host loses (threads spinning at barriers, cache and GIL
contention). Rates change only when an activity on the host starts or ends;
then every activity's remaining work is brought up to date and its finish
timer moved.

Engines may also name a ``thread`` on the host: the busy periods of the
engines on one thread take turns on it (replicas of an engine that runs in
the driver's interpreter, which holds one lock for its Python work). The
thread counts as one activity on the host, of the largest demand among its
busy periods, and while ``n`` of them are active each progresses at ``1 / n``
of the thread's rate: two replicas on one thread take as long as one doing
both batches.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import EngineError

__all__ = ["Activity", "SimHost", "SimHostShare", "host_for"]


class SimHostShare(BaseModel):
    """An engine's place on a shared host (``machine:`` of a sim rollout, train or reward option block)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("host", min_length=1, description="Engines naming the same host share its capacity.")
    capacity: float = Field(..., gt=0, description="Cores of the host (the same on every engine that names it).")
    efficiency: float = Field(
        1.0, gt=0, le=1, description="Fraction of the capacity a contended host (two activities or more, more "
        "demand than capacity) still delivers "
        "(the same on every engine that names it; 1: pure processor sharing).")
    demand: float = Field(..., gt=0, description="Cores this engine keeps busy when it runs alone (may exceed "
                          "capacity: then it is slowed by the others in proportion to its demand).")
    thread: str | None = Field(
        None, min_length=1, description="Engines naming the same thread take turns on it (replicas of an engine in "
        "the driver's process, whose interpreter runs one at a time): n busy at once each progress 1/n as fast as "
        "the thread. None: the engine's busy periods run side by side (their own processes).")


@dataclass(eq=False)
class Activity:
    """A busy period on the host: ``remaining`` modelled seconds of work at ``rate`` since loop time ``since``."""

    demand: float
    remaining: float
    scale: float  #: loop seconds per modelled second
    future: asyncio.Future
    since: float
    rate: float = 1.0
    done: float = 0.0  #: modelled seconds of work done so far
    handle: asyncio.TimerHandle | None = None
    thread: str | None = None  #: busy periods of one thread take turns (None: its own)


class SimHost:
    """The cores of one simulated machine, shared by the activities of the engines placed on it."""

    def __init__(self, name: str, capacity: float, efficiency: float = 1.0) -> None:
        self.name = name
        self.capacity = float(capacity)
        self.efficiency = float(efficiency)
        self._active: dict[Activity, None] = {}  # insertion-ordered: deterministic timer order
        self.busy_seconds = 0.0  #: loop seconds with at least one activity (for reports)
        self.contended_seconds = 0.0  #: loop seconds with the host contended
        self._mark: float | None = None
        #: whether the activities running now contend (set by every replan: the active set changes only there)
        self._contended_now = False

    def rate(self, demand: float, total: float, count: int) -> float:
        """Progress per loop second (in modelled seconds, before ``time_scale``) of an activity of ``demand``
        while ``count`` activities whose demands sum to ``total`` are active."""
        cap = self.capacity
        share = min(1.0, (self.efficiency if self._contended(total, count) else 1.0) * cap / total)
        return share / min(1.0, cap / demand)

    def _contended(self, total: float, count: int) -> bool:
        return count > 1 and total > self.capacity * (1 + 1e-12)

    @property
    def active(self) -> int:
        """Activities running on the host now."""
        return len(self._active)

    def start(self, work: float, demand: float, scale: float, future: asyncio.Future, *,
              thread: str | None = None) -> Activity:
        """Begin ``work`` modelled seconds of work (on ``thread``: taking turns with its other busy periods);
        ``future`` gets ``False`` when it is done (unless resolved earlier by its owner, who then calls
        :meth:`stop`)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._advance(now)
        act = Activity(demand, max(0.0, work), scale, future, now, thread=thread)
        self._active[act] = None
        self._replan(loop, now)
        return act

    def stop(self, act: Activity) -> float:
        """End ``act`` now (finished or interrupted); returns the modelled seconds of work it did."""
        if act in self._active:
            loop = asyncio.get_running_loop()
            now = loop.time()
            self._advance(now)
            del self._active[act]
            if act.handle is not None:
                act.handle.cancel()
            self._replan(loop, now)
        return act.done

    async def spend(self, work: float, demand: float, scale: float = 1.0, *, thread: str | None = None) -> None:
        """Do ``work`` modelled seconds of work on the host (an uninterruptible busy period)."""
        fut = asyncio.get_running_loop().create_future()
        act = self.start(work, demand, scale, fut, thread=thread)
        try:
            await fut
        finally:
            self.stop(act)

    # -- bookkeeping ----------------------------------------------------------------------
    def _load(self) -> tuple[float, int, dict[str, tuple[float, int]]]:
        """(total demand, activities, thread -> (its demand, its busy periods)): a thread counts once, with the
        largest demand among its busy periods."""
        threads: dict[str, tuple[float, int]] = {}
        total, count = 0.0, 0
        for a in self._active:
            if a.thread is None:
                total += a.demand
                count += 1
            else:
                d, n = threads.get(a.thread, (0.0, 0))
                threads[a.thread] = (max(d, a.demand), n + 1)
        for d, _ in threads.values():
            total += d
            count += 1
        return total, count, threads

    def _advance(self, now: float) -> None:
        if self._mark is not None and self._active:
            span = now - self._mark
            self.busy_seconds += span
            if self._contended_now:
                self.contended_seconds += span
        self._mark = now
        for act in self._active:
            step = (now - act.since) * act.rate / act.scale
            act.done += step
            act.remaining = max(0.0, act.remaining - step)
            act.since = now

    def _replan(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        total, count, threads = self._load()
        self._contended_now = self._contended(total, count)
        for act in self._active:
            if act.thread is None:
                rate = self.rate(act.demand, total, count)
            else:
                demand, turns = threads[act.thread]
                rate = self.rate(demand, total, count) / turns
            if act.handle is not None and rate == act.rate:
                continue  # same rate, same finish time: keep the timer
            act.rate = rate
            if act.handle is not None:
                act.handle.cancel()
            act.handle = loop.call_at(now + act.remaining * act.scale / rate, self._finish, act)

    def _finish(self, act: Activity) -> None:
        if act not in self._active:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._advance(now)
        act.done += act.remaining  # the timer is the finish: no rounding left over
        act.remaining = 0.0
        act.handle = None
        del self._active[act]
        self._replan(loop, now)
        if not act.future.done():
            act.future.set_result(False)


#: running loop -> host name -> host (a loop's hosts go with it)
_HOSTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, SimHost]] = weakref.WeakKeyDictionary()


def host_for(share: SimHostShare) -> SimHost:
    """The host ``share`` names on the running loop (made by the first engine that asks)."""
    hosts = _HOSTS.setdefault(asyncio.get_running_loop(), {})
    host = hosts.get(share.name)
    if host is None:
        host = hosts[share.name] = SimHost(share.name, share.capacity, share.efficiency)
    elif (host.capacity, host.efficiency) != (share.capacity, share.efficiency):
        raise EngineError(
            f"sim host {share.name!r} has capacity {host.capacity:g} and efficiency {host.efficiency:g} on one engine "
            f"and {share.capacity:g} / {share.efficiency:g} on another; give every engine on it the same host options")
    return host
