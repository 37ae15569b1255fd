"""A virtual-clock asyncio event loop: simulated hours pass in milliseconds of wall time.

:class:`VirtualClockLoop` is a :class:`asyncio.SelectorEventLoop` whose
:meth:`~VirtualClockLoop.time` is a number the loop moves itself. When no
callback is ready, instead of sleeping until the next timer it *jumps* the
clock to that timer. Everything built on ``loop.time()`` and ``call_at`` —
``asyncio.sleep``, ``wait_for``, ``asyncio.timeout``, ``Event``, ``Queue``,
``Condition`` — works unchanged, so the real flow runtime and the real store
run on simulated engines without knowing.

Real work is still real:

- Sockets and pipes are polled with a zero timeout at every iteration, so
  ready I/O is handled and never blocks the simulation. While the loop's own
  self-pipe is all that is registered (a simulated run), an iteration with
  callbacks ready polls it only every ``SELF_PIPE_POLL_EVERY``-th time: it
  carries no work of its own (a cross-thread ``call_soon_threadsafe`` puts
  its callback on the ready queue directly), and it is always polled before
  the clock moves.
- Work in threads (``asyncio.to_thread``, ``loop.run_in_executor``, and
  anything wrapped in :meth:`VirtualClockLoop.hold_clock`) *freezes* the
  clock: while it is pending the loop waits, in real time, for it to finish,
  so it takes zero simulated time and the simulation stays deterministic.
  A thread that is still pending after ``stall_timeout_s`` real seconds with
  nothing else happening raises :class:`VirtualClockStall` (a thread waiting
  on simulated time would otherwise wait forever).
- Nothing ready, no timer, no thread work: every task waits on something
  that can never happen. After ``deadlock_grace_s`` real seconds of waiting
  for a cross-thread wake-up, :class:`VirtualClockDeadlock` is raised, naming
  the waiting tasks — the simulation never hangs silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import selectors
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from asyncflow_core.flow.heap import fewer_full_collections

T = TypeVar("T")

__all__ = ["VirtualClockDeadlock", "VirtualClockLoop", "VirtualClockStall", "run_virtual"]


class VirtualClockDeadlock(RuntimeError):
    """Nothing can ever run again: no ready callback, no timer, no pending real work."""


class VirtualClockStall(RuntimeError):
    """Real (thread) work kept the virtual clock frozen for longer than ``stall_timeout_s``."""


#: with only the loop's self-pipe registered, a zero-timeout select (callbacks ready) polls it once in this many
SELF_PIPE_POLL_EVERY = 64


class _VirtualSelector(selectors.BaseSelector):
    """Wraps the real selector; ``select`` decides whether to poll, wait for real work, or jump the clock."""

    def __init__(self, real: selectors.BaseSelector) -> None:
        self._real = real
        self._loop: VirtualClockLoop | None = None
        self._registered = 0  # file objects registered (the loop's self-pipe is the first)
        self._skipped = 0  # zero-timeout polls skipped since the last real one

    # -- plain delegation ------------------------------------------------------
    def register(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        key = self._real.register(fileobj, events, data)
        self._registered += 1
        return key

    def unregister(self, fileobj):  # type: ignore[no-untyped-def]
        key = self._real.unregister(fileobj)
        self._registered -= 1
        return key

    def modify(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj):  # type: ignore[no-untyped-def]
        return self._real.get_key(fileobj)

    def get_map(self):  # type: ignore[no-untyped-def]
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    # -- the virtual part --------------------------------------------------------
    def select(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        loop = self._loop
        if timeout == 0:
            # Callbacks are ready. With nothing but the self-pipe registered there is no I/O to hand over: a
            # thread's call_soon_threadsafe already queued its callback; the pipe is drained now and then, and
            # always before the clock moves (below).
            if loop is not None and self._registered <= 1 and self._skipped < SELF_PIPE_POLL_EVERY:
                self._skipped += 1
                return []
            self._skipped = 0
            return self._real.select(0)
        if loop is None:
            return self._real.select(timeout)
        self._skipped = 0
        events = self._real.select(0)  # real I/O first, and it never blocks the simulation
        if events:
            return events
        if loop._real_pending:
            # Thread work is in flight: the clock stays frozen and we wait for it in real time.
            # A completing executor future wakes this select through the loop's self-pipe.
            events = self._real.select(loop.stall_timeout_s)
            if not events and loop._real_pending:
                raise VirtualClockStall(
                    f"{loop._real_pending} piece(s) of real work (threads from to_thread/run_in_executor or "
                    f"hold_clock() sections) kept the virtual clock frozen for {loop.stall_timeout_s:g}s of real "
                    "time with nothing else happening. A thread that waits on simulated time can never finish; "
                    "raise stall_timeout_s if the work is just slow."
                )
            return events
        if timeout is None:
            # No ready callback and no timer: only another thread (call_soon_threadsafe) or real I/O can
            # still wake us. Give them a short real grace, then declare the deadlock.
            events = self._real.select(loop.deadlock_grace_s)
            if events:
                return events
            raise VirtualClockDeadlock(loop._deadlock_report())
        loop._jump_to_next_timer(timeout)
        return []


class _FifoTimerHandle(asyncio.TimerHandle):
    """A timer that sorts after earlier-scheduled timers with the same deadline.

    On a frozen clock many timers share one deadline; asyncio's heap alone
    would run them in an arbitrary (if deterministic) order.
    """

    __slots__ = ("_seq",)

    def __lt__(self, other: object) -> bool:
        # the loop's heap compares timers millions of times in a large simulation: no tuples, no isinstance
        try:
            when, other_when = self._when, other._when  # type: ignore[attr-defined]
            if when != other_when:
                return when < other_when
            return self._seq < other._seq  # type: ignore[attr-defined]
        except AttributeError:
            return super().__lt__(other)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop whose clock jumps to the next timer instead of sleeping.

    - ``start``: the clock's initial reading (seconds).
    - ``deadlock_grace_s``: real seconds to wait for a cross-thread wake-up
      before raising :class:`VirtualClockDeadlock` when nothing is scheduled.
    - ``stall_timeout_s``: real seconds thread work may keep the clock frozen
      with nothing else happening before :class:`VirtualClockStall`.

    Use :func:`run_virtual` as you would :func:`asyncio.run`, or pass this
    class as ``loop_factory`` to :class:`asyncio.Runner`.
    """

    def __init__(self, *, start: float = 0.0, deadlock_grace_s: float = 0.5, stall_timeout_s: float = 300.0) -> None:
        self._now = float(start)
        self._real_pending = 0
        self._timer_seq = 0
        self.deadlock_grace_s = float(deadlock_grace_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self.jumps = 0  #: how many times the clock jumped forward (a cheap measure of simulated events)
        selector = _VirtualSelector(selectors.DefaultSelector())
        super().__init__(selector)
        selector._loop = self

    def time(self) -> float:
        """The virtual clock's reading in seconds."""
        return self._now

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any, context: Any = None) -> asyncio.TimerHandle:
        """Like the base method, but timers with equal deadlines run in the order they were scheduled."""
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        if self._debug:
            self._check_thread()
            self._check_callback(callback, "call_at")
        timer = _FifoTimerHandle(when, callback, args, self, context)
        if timer._source_traceback:
            del timer._source_traceback[-1]
        self._timer_seq += 1
        timer._seq = self._timer_seq
        heapq.heappush(self._scheduled, timer)
        timer._scheduled = True
        return timer

    # -- real work freezes the clock ------------------------------------------------
    @contextlib.contextmanager
    def hold_clock(self) -> Iterator[None]:
        """Freeze the virtual clock while the block runs (for real work the loop must wait for).

        Use it around awaits on things that complete in *real* time but are
        not executor futures (a reply from another process, a foreign
        thread's ``call_soon_threadsafe``)::

            with loop.hold_clock():
                await reply_from_worker_process
        """
        self._real_pending += 1
        try:
            yield
        finally:
            self._real_pending -= 1

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Like the base method; the clock stays frozen until the returned future is done."""
        fut = super().run_in_executor(executor, func, *args)
        self._real_pending += 1
        fut.add_done_callback(self._real_done)
        return fut

    def _real_done(self, _fut: asyncio.Future) -> None:
        self._real_pending -= 1

    async def shutdown_default_executor(self, *args: Any, **kwargs: Any) -> None:
        # Joining the executor's threads is real work; on 3.12+ the base method also arms a
        # timeout that a jumping clock would fire at once.
        with self.hold_clock():
            await super().shutdown_default_executor(*args, **kwargs)

    # -- clock movement ------------------------------------------------------------
    def _jump_to_next_timer(self, timeout: float) -> None:
        scheduled = getattr(self, "_scheduled", None)
        # Jump exactly to the head timer's deadline (now + timeout can be one ulp short of it).
        target = scheduled[0]._when if scheduled else self._now + timeout
        if target > self._now:
            self._now = target
            self.jumps += 1

    def _deadlock_report(self) -> str:
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        shown = []
        for task in tasks[:10]:
            coro = task.get_coro()
            frame = getattr(coro, "cr_frame", None)
            where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
            shown.append(f"  - {task.get_name()}: {getattr(coro, '__qualname__', coro)!r}{where}")
        more = f"\n  ... and {len(tasks) - 10} more" if len(tasks) > 10 else ""
        listing = "\n".join(shown) if shown else "  (no task is waiting: a bare future is never resolved)"
        return (
            f"deadlock on the virtual clock at t={self._now:.6f}s: no callback is ready, no timer is scheduled "
            f"and no real work is pending, so nothing can ever wake these tasks:\n{listing}{more}\n"
            "Look for an Event/Queue/Future that nothing will set, or wrap real cross-thread waits in "
            "loop.hold_clock()."
        )


def run_virtual(
    coro: Coroutine[Any, Any, T],
    *,
    start: float = 0.0,
    deadlock_grace_s: float = 0.5,
    stall_timeout_s: float = 300.0,
    debug: bool | None = None,
) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualClockLoop`, like :func:`asyncio.run`.

    Raises :class:`VirtualClockDeadlock` instead of hanging when every task
    waits on something that can never happen.
    """

    def factory() -> VirtualClockLoop:
        return VirtualClockLoop(start=start, deadlock_grace_s=deadlock_grace_s, stall_timeout_s=stall_timeout_s)

    with fewer_full_collections(), asyncio.Runner(debug=debug, loop_factory=factory) as runner:
        return runner.run(coro)

