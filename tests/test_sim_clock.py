"""The virtual-clock event loop: timers jump, order holds, asyncio primitives work, deadlocks are reported."""

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.flow.clock import VirtualClockDeadlock, VirtualClockLoop, VirtualClockStall, run_virtual


def test_ten_simulated_hours_of_timers_take_under_a_second():
    async def body():
        loop = asyncio.get_running_loop()
        for _ in range(36_000):
            await asyncio.sleep(1.0)
        return loop.time()

    wall = time.perf_counter()
    assert run_virtual(body()) == pytest.approx(36_000.0)
    assert time.perf_counter() - wall < 1.0 * _slack()


def test_start_sets_the_clock_and_one_long_sleep_is_instant():
    async def body():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(3600)
        return t0, loop.time()

    wall = time.perf_counter()
    assert run_virtual(body(), start=100.0) == (100.0, 3700.0)
    assert time.perf_counter() - wall < 1.0 * _slack()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=30))
def test_timers_fire_in_deadline_order_at_their_deadline(delays):
    async def body():
        loop = asyncio.get_running_loop()
        fired = []
        for i, d in enumerate(delays):
            loop.call_later(d, lambda i=i: fired.append((loop.time(), i)))
        await asyncio.sleep(max(delays) + 1)
        return fired

    fired = run_virtual(body())
    # ties keep scheduling order, like a real loop
    expected = sorted(range(len(delays)), key=lambda i: (delays[i], i))
    assert [i for _, i in fired] == expected
    for t, i in fired:
        assert t == pytest.approx(delays[i], abs=1e-6)


def test_wait_for_timeout_event_queue_and_condition_work():
    async def body():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 3600)
        assert loop.time() == pytest.approx(3600)

        queue: asyncio.Queue[int] = asyncio.Queue()

        async def producer():
            for i in range(3):
                await asyncio.sleep(10)
                queue.put_nowait(i)

        task = asyncio.ensure_future(producer())
        got = [await queue.get() for _ in range(3)]
        await task
        assert got == [0, 1, 2] and loop.time() == pytest.approx(3630)

        cond = asyncio.Condition()
        state = {"ready": False}

        async def setter():
            await asyncio.sleep(5)
            async with cond:
                state["ready"] = True
                cond.notify_all()

        asyncio.ensure_future(setter())
        async with cond:
            await cond.wait_for(lambda: state["ready"])
        assert loop.time() == pytest.approx(3635)
        async with asyncio.timeout(1.5):
            await asyncio.sleep(1)

    run_virtual(body())


def test_thread_work_freezes_the_clock_and_completes():
    async def body():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # a far timer must not fire while the thread is still working
        far = asyncio.ensure_future(asyncio.sleep(1000))
        value = await asyncio.wait_for(asyncio.to_thread(lambda: (time.sleep(0.05), 7)[1]), timeout=1)
        assert value == 7 and loop.time() == t0, "thread work takes zero simulated time"
        assert not far.done()
        await far
        assert loop.time() == pytest.approx(t0 + 1000)

    run_virtual(body())


def test_hold_clock_waits_for_a_foreign_thread():
    async def body():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        threading.Timer(0.05, lambda: loop.call_soon_threadsafe(fut.set_result, "hi")).start()
        asyncio.ensure_future(asyncio.sleep(50))  # would otherwise be jumped to first
        with loop.hold_clock():
            assert await fut == "hi"
        return loop.time()

    assert run_virtual(body()) == 0.0


def test_foreign_thread_wake_up_within_the_grace_is_not_a_deadlock():
    async def body():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        threading.Timer(0.05, lambda: loop.call_soon_threadsafe(fut.set_result, 1)).start()
        return await fut

    assert run_virtual(body(), deadlock_grace_s=2.0) == 1


def test_deadlock_is_reported_naming_the_waiting_task():
    async def stuck_forever():
        await asyncio.Event().wait()

    async def body():
        task = asyncio.ensure_future(stuck_forever())
        await task

    with pytest.raises(VirtualClockDeadlock, match="stuck_forever"):
        run_virtual(body(), deadlock_grace_s=0.01)


def test_a_thread_waiting_on_simulated_time_is_a_stall_not_a_hang():
    async def body():
        loop = asyncio.get_running_loop()
        # the thread waits for a simulated sleep, but the clock is frozen while the thread runs
        await asyncio.to_thread(lambda: asyncio.run_coroutine_threadsafe(asyncio.sleep(1), loop).result(timeout=5))

    with pytest.raises(VirtualClockStall, match="stall_timeout_s"):
        run_virtual(body(), stall_timeout_s=0.2)


def test_loop_can_be_used_with_asyncio_runner():
    async def body():
        await asyncio.sleep(10)
        return asyncio.get_running_loop().time()

    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        assert runner.run(body()) == 10.0


def _slack() -> float:
    """Wall-time bounds are generous: CI machines are shared and slow."""
    return 3.0


def test_full_collections_are_rarer_inside_a_virtual_run_and_the_rate_comes_back_after():
    import gc

    before = gc.get_threshold()

    async def body():
        return gc.get_threshold()

    inside = run_virtual(body())
    assert inside[:2] == before[:2] and inside[2] == max(before[2], 100)
    assert gc.get_threshold() == before

    async def boom():
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        run_virtual(boom())
    assert gc.get_threshold() == before  # restored when the run raises, too


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=60))
def test_timers_with_shared_deadlines_fire_in_scheduling_order_around_cancellations(plan):
    # few distinct deadlines, so most timers tie: the heap's comparison must fall back to the scheduling order
    async def body():
        loop = asyncio.get_running_loop()
        fired, handles = [], []
        for i, (d, cancel) in enumerate(plan):
            handles.append((loop.call_later(float(d), fired.append, i), cancel))
        for h, cancel in handles:
            if cancel:
                h.cancel()
        await asyncio.sleep(4.0)
        return fired

    kept = [i for i, (_, cancel) in enumerate(plan) if not cancel]
    assert run_virtual(body()) == sorted(kept, key=lambda i: (plan[i][0], i))


def test_a_registered_socket_is_read_while_callbacks_keep_the_loop_busy():
    # the self-pipe alone is polled now and then; a real file object must be polled on every iteration
    import socket

    async def body():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        got: list[int] = []
        spins = 0

        def on_readable() -> None:
            got.append(spins)
            a.recv(16)

        loop.add_reader(a.fileno(), on_readable)
        try:
            b.send(b"x")
            while not got and spins < 10_000:  # ready callbacks every iteration: the clock never moves
                spins += 1
                await asyncio.sleep(0)
        finally:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()
        return got

    got = run_virtual(body())
    assert got and got[0] <= 2  # handled on the next iteration or so, not after dozens of skipped polls


def test_a_thread_callback_runs_while_callbacks_keep_the_loop_busy():
    # call_soon_threadsafe queues its callback directly: skipping self-pipe polls must not delay it
    async def body():
        loop = asyncio.get_running_loop()
        seen = threading.Event()
        done: list[int] = []
        spins = 0
        threading.Thread(target=lambda: (loop.call_soon_threadsafe(done.append, 1), seen.set())).start()
        while not done and spins < 1_000_000:
            spins += 1
            await asyncio.sleep(0)
        return done, seen.wait(5)

    assert run_virtual(body()) == ([1], True)
