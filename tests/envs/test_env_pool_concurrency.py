"""Worker processes run blocking steps side by side: one process serves several blocking steps at once, and
episodes whose steps do not block are decoded and finish while others are held inside their tools.

The gated steps (tests/envs/pool_fixtures.py) block their thread with ``time.sleep`` until the test creates a
``go`` file, and count how many of them are inside at once. No timing is asserted: the test waits for the
steps to have started (marker files), then releases them; a pool that runs one blocking step at a time per
process never gets that far and ends with the counts that show it (each wait is bounded).
"""

from __future__ import annotations

import asyncio
import os

from asyncflow_core.flow.env_pool import EnvironmentPool
from asyncflow_core.flow.episode import MultiTurnEpisodes
from asyncflow_core.interfaces import Action
from asyncflow_core.types import PromptRecord

from .pool_fixtures import entered, make_gated

BOUND_S = 30.0  #: the longest any gate or wait here lasts when the pool is wrong (never reached when right)


def act(turn: int) -> Action:
    return Action(token_ids=(), text="x", finish_reason="stop", turn=turn)


async def _until(predicate, bound_s: float = BOUND_S) -> bool:
    """Poll ``predicate`` on this loop until it holds or ``bound_s`` passes; whether it held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _gated_steps(pool: EnvironmentPool, folder, k: int):
    """Open k episodes, start their gated steps together; release them once all k are inside."""
    envs = [await pool.open() for _ in range(k)]
    for i, env in enumerate(envs):
        await env.reset({"dir": str(folder), "bound_s": BOUND_S, "name": f"e{i}"}, seed=i)
    steps = [asyncio.ensure_future(env.step(act(0))) for env in envs]
    all_inside = await _until(lambda: entered(folder) >= k)
    inside_at_release = entered(folder)
    (folder / "go").touch()
    results = await asyncio.gather(*steps)
    for env in envs:
        await env.close()
    return all_inside, inside_at_release, results


def test_one_worker_process_runs_k_blocking_steps_at_once(tmp_path):
    k = 6

    async def main():
        async with EnvironmentPool(make_gated, processes=1, workers=k, step_timeout_s=2 * BOUND_S) as pool:
            out = await _gated_steps(pool, tmp_path, k)
            return (*out, pool.in_flight)

    all_inside, inside, steps, in_flight = asyncio.run(main())
    assert (all_inside, inside) == (True, k)
    assert [s.reward for s in steps] == [1.0] * k  # every step was inside before the release, and saw it
    assert {s.info["peak"] for s in steps} == {k}  # k gated steps inside one process at the same time
    assert len({s.info["thread"] for s in steps}) == k and len({s.info["pid"] for s in steps}) == 1
    assert os.getpid() not in {s.info["pid"] for s in steps} and in_flight == 0


def test_episodes_spread_over_the_processes_and_each_runs_its_share_at_once(tmp_path):
    k, processes = 4, 2

    async def main():
        async with EnvironmentPool(make_gated, processes=processes, workers=k, step_timeout_s=2 * BOUND_S) as pool:
            return await _gated_steps(pool, tmp_path, k)

    all_inside, inside, steps = asyncio.run(main())
    assert (all_inside, inside) == (True, k) and [s.reward for s in steps] == [1.0] * k
    pids = [s.info["pid"] for s in steps]
    assert len(set(pids)) == processes and all(pids.count(p) == k // processes for p in set(pids))
    assert {s.info["peak"] for s in steps} == {k // processes}


def test_through_the_rollout_stage_other_episodes_decode_and_finish_while_blocking_tools_hold(tmp_path):
    """k episodes' first steps block inside the one worker process; the other episodes (same process, same
    pool) must be decoded by the engine and written before the test releases the k: a step that held its
    process, or a waiting episode that held a decode slot (max_inflight 2 < k), would stop them."""
    from tests.flow.test_episode import FakeEngine, _run, ep_settings

    k, others = 3, 5
    recs = [PromptRecord(i, f"q{i} ", metadata={"dir": str(tmp_path), "bound_s": BOUND_S} if i < k
                         else {"turns": 3}) for i in range(k + others)]
    seen: dict[str, int] = {}

    async def release(ctx):
        ok = await _until(lambda: entered(tmp_path) >= k and ctx.counters["episodes_done"] >= others)
        seen.update(inside=entered(tmp_path), done=ctx.counters["episodes_done"], ok=int(ok))
        (tmp_path / "go").touch()

    async def main():
        async with EnvironmentPool(make_gated, processes=1, workers=k + others,
                                   step_timeout_s=2 * BOUND_S) as pool:
            eps = MultiTurnEpisodes(ep_settings(pool.open, step_timeout_s=2 * BOUND_S))
            return await _run(recs, eps, engines=[FakeEngine()], max_inflight=2,
                              started=lambda ctx, stage: release(ctx))

    batch, order, ctx, _, _ = asyncio.run(main())
    assert seen == {"inside": k, "done": others, "ok": 1}  # the others finished while the k were held
    assert ctx.counters["episodes_done"] == k + others and ctx.counters["episodes_failed"] == 0
