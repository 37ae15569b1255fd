"""EnvironmentPool: time limits, failures with reasons, close always, worker processes that keep the loop free."""

from __future__ import annotations

import asyncio

import pytest

from asyncflow_core.errors import EnvironmentFailure
from asyncflow_core.flow.env_pool import EnvironmentPool
from asyncflow_core.interfaces import Action

from .env_fixtures import CLOSED, make_scripted


def act(turn: int, text: str = "x") -> Action:
    return Action(token_ids=(), text=text, finish_reason="stop", turn=turn)


def run(coro, timeout: float = 120.0):
    async def guarded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


async def episode(pool: EnvironmentPool, record: dict, turns: int = 3):
    async with pool.episode() as env:
        await env.reset(record, seed=7)
        steps = []
        for t in range(turns):
            step = await env.step(act(t))
            steps.append(step)
            if step.done:
                break
        return env, steps


def test_in_loop_episode_runs_and_is_timed():
    CLOSED.clear()

    async def main():
        pool = EnvironmentPool(make_scripted, step_timeout_s=30)
        env, steps = await episode(pool, {"name": "a", "turns": 2})
        return env, steps, pool.in_flight

    env, steps, in_flight = run(main())
    assert [s.done for s in steps] == [False, True] and steps[-1].reward == 1.0
    assert [t.call for t in env.timings] == ["open", "reset", "step", "step", "close"]
    assert [t.turn for t in env.timings if t.call == "step"] == [0, 1]
    assert env.seconds == sum(t.seconds for t in env.timings) and env.seconds >= 0
    assert CLOSED == ["a"] and in_flight == 0 and env.features.owns_reward


def test_in_loop_timeout_is_a_failure_with_reason_and_close_still_runs():
    CLOSED.clear()

    async def main():
        pool = EnvironmentPool(make_scripted, step_timeout_s=0.05)
        with pytest.raises(EnvironmentFailure) as info:
            await episode(pool, {"name": "slow", "mode": "hang", "at": 1, "turns": 3})
        return info.value, pool.in_flight

    failure, in_flight = run(main())
    assert "step (turn 1) timed out after 0.05s" in failure.reason and "step_timeout_s" in failure.reason
    assert failure.call == "step" and failure.turn == 1
    assert "\n" not in failure.reason
    assert CLOSED == ["slow"] and in_flight == 0


@pytest.mark.parametrize("mode, call, turn, text", [
    ("raise", "step", 0, "step (turn 0) failed: ValueError: boom"),
    ("raise_reset", "reset", None, "reset failed: RuntimeError: no such task"),
    ("bad_step", "step", 0, "step (turn 0) failed: TypeError: step returned str, not a Step"),
])
def test_in_loop_exceptions_become_failures_naming_call_and_turn(mode, call, turn, text):
    CLOSED.clear()

    async def main():
        pool = EnvironmentPool(make_scripted)
        with pytest.raises(EnvironmentFailure) as info:
            await episode(pool, {"name": mode, "mode": mode, "at": 0})
        return info.value

    failure = run(main())
    assert failure.reason == f"environment {text}"
    assert (failure.call, failure.turn) == (call, turn)
    assert CLOSED == [mode]  # close ran after the failure


def test_close_failure_after_a_good_episode_is_reported():
    CLOSED.clear()

    async def main():
        pool = EnvironmentPool(make_scripted)
        with pytest.raises(EnvironmentFailure, match="close failed: OSError: cannot release"):
            await episode(pool, {"name": "c", "mode": "raise_close"})
        return pool.in_flight

    assert run(main()) == 0 and CLOSED == ["c"]


def test_open_failure_is_a_failure_and_frees_the_slot():
    def broken():
        raise ImportError("missing dependency")

    async def main():
        pool = EnvironmentPool(broken, workers=1)
        for _ in range(2):  # the slot came back: a second open does not wait forever
            with pytest.raises(EnvironmentFailure, match="open failed: ImportError: missing dependency"):
                await pool.open()
        return pool.in_flight

    assert run(main()) == 0


def test_workers_bounds_open_environments():
    async def main():
        pool = EnvironmentPool(make_scripted, workers=2)
        a, b = await pool.open(), await pool.open()
        third = asyncio.ensure_future(pool.open())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        waited = not third.done()
        await a.close()
        c = await third
        assert pool.in_flight == 2
        await b.close()
        await c.close()
        await a.close()  # closing twice is a no-op, never a second release
        return waited, pool.in_flight

    assert run(main()) == (True, 0)


def test_blocking_step_in_a_worker_process_leaves_the_event_loop_free(tmp_path):
    """The step blocks its process until a file exists; only this event loop creates the file.

    If the step ran in the event loop, the loop could not create the file and the step would give up
    (reward 0) after its bound; in a worker process the loop runs on, so the step sees the file.
    """
    flag = tmp_path / "go"
    order: list[str] = []

    async def main():
        async with EnvironmentPool(make_scripted, processes=1, step_timeout_s=60) as pool:
            async with pool.episode() as env:
                await env.reset({"mode": "wait_file", "path": str(flag)}, seed=0)
                step_task = asyncio.ensure_future(env.step(act(0)))

                async def responsive():
                    while len(order) < 3:  # the loop keeps ticking while the step blocks its worker
                        order.append("tick")
                        await asyncio.sleep(0)
                    flag.touch()
                    order.append("file")

                await responsive()
                step = await step_task
                order.append("step")
                return step

    step = run(main())
    assert order == ["tick", "tick", "tick", "file", "step"]
    assert step.done and step.reward == 1.0


def test_the_same_blocking_step_in_the_loop_stalls_it(tmp_path):
    """The contrast: in the event loop the step holds the loop, so the file is created only after it gave up."""
    flag = tmp_path / "go"
    order: list[str] = []

    async def main():
        pool = EnvironmentPool(make_scripted, step_timeout_s=60)
        async with pool.episode() as env:
            await env.reset({"mode": "wait_file", "path": str(flag), "bound_s": 0.2}, seed=0)
            step_task = asyncio.ensure_future(env.step(act(0)))

            async def creator():
                await asyncio.sleep(0)
                order.append("file")
                flag.touch()

            creator_task = asyncio.ensure_future(creator())
            step = await step_task
            order.append("step")
            await creator_task
            return step

    step = run(main())
    assert step.reward == 0.0  # the loop was held: the file did not exist while the step waited


def test_worker_process_timeout_restarts_the_worker_and_later_episodes_run():
    CLOSED.clear()

    async def main():
        async with EnvironmentPool(make_scripted, processes=1, step_timeout_s=1.0) as pool:
            with pytest.raises(EnvironmentFailure) as info:
                await episode(pool, {"mode": "block", "at": 1, "turns": 3})
            first = info.value
            _, steps = await episode(pool, {"turns": 2})
            return first, steps, pool.in_flight

    failure, steps, in_flight = run(main())
    assert "step (turn 1) timed out after 1s" in failure.reason and "worker process was restarted" in failure.reason
    assert steps[-1].done and steps[-1].reward == 1.0 and in_flight == 0


def test_worker_process_exception_is_a_failure_with_reason():
    async def main():
        async with EnvironmentPool(make_scripted, processes=1) as pool:
            with pytest.raises(EnvironmentFailure) as info:
                await episode(pool, {"mode": "raise", "at": 2, "turns": 4})
            env, steps = await episode(pool, {"turns": 1})
            return info.value, env, steps

    failure, env, steps = run(main())
    assert failure.reason == "environment step (turn 2) failed: ValueError: boom"
    assert (failure.call, failure.turn) == ("step", 2)
    assert steps[0].done and env.features.blocking and [t.call for t in env.timings][0] == "open"


def test_pool_from_plugin_chooses_processes_from_declared_features():
    pool = EnvironmentPool.from_plugin("calculator")
    assert pool.processes == 0
    blocking = EnvironmentPool.from_plugin("tool_calls", {"blocking": True})
    assert blocking.processes > 0
    assert EnvironmentPool.from_plugin("tool_calls", {"blocking": True}, processes=0).processes == 0
