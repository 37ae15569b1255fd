"""``async.start_on_step_weights``: a prompt starts only on weights the step it is admitted for can use.

Without it, the prompts admitted the moment the trainer's version moves start on the replica's previous weights
(the replica is still loading the newest), come out two versions old one step later, and are generated again.
The runs here are the real runtime and store on the simulated engines, seeded, on a virtual clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncflow_core.config.loader import resolve
from asyncflow_core.config.models import AsyncConfig, RunConfig
from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.clock import run_virtual
from asyncflow_core.flow.engine_pool import EnginePool
from asyncflow_core.flow.runtime import FlowRuntime
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.types import PromptRecord
from tests.flow.test_rollout_sends import SilentEngine, _stage

B, N, STEPS = 6, 4, 8


def test_the_floor_is_the_admission_steps_oldest_usable_version_capped_at_the_trainers():
    # one_step, 4 prompts a step: positions 0-7 are for steps 0-1 (floor 0), 8-11 for step 2 (floor 1)
    assert [S.start_floor(p, 4, 1, version=5) for p in (0, 7, 8, 11, 12)] == [0, 0, 1, 1, 2]
    assert S.start_floor(12, 4, 0, version=3) == 3  # sync: its own step
    assert S.start_floor(12, 4, 1, version=1) == 1  # beyond the bound (over-provisioned): the weights that exist
    assert S.start_floor(40, 4, 2, version=9) == 8


def test_it_is_off_unless_declared():
    assert AsyncConfig().start_on_step_weights is False
    assert S.TailPolicy.from_config(AsyncConfig(start_on_step_weights=True)).step_weights is True


def _config(flag: bool, replicas: int, sigma: float) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 3,
        "data": {"name": "sim", "options": {"size": 400, "prompt_tokens": 64}, "prompts_per_step": B},
        "rollout": {"name": "sim", "replicas": replicas, "n": N, "max_new_tokens": 512, "max_inflight": 32,
                    "rows_per_lease": 8,
                    "options": {"payload": "lengths", "lengths": {"median_tokens": 100, "sigma": sigma}}},
        "trainer": {"name": "sim", "options": {"latency": {"devices": 1}}, "total_steps": STEPS},
        "weight_transport": {"name": "sim"},
        "algorithm": {"name": "grpo", "options": {"group_size": N}},
        "reward": {"name": "sim"},
        "async": {"mode": "one_step", "start_on_step_weights": flag},
        "logging": {"level": "WARNING"},
    })


def _run(cfg: RunConfig, monkeypatch: Any) -> tuple[dict, FlowRuntime, list[tuple[int, int]]]:
    """The summary, the runtime, and (the version a request started on, its group's floor) per rollout request."""
    runtime = FlowRuntime(resolve(cfg), write_png=False)
    starts: list[tuple[int, int]] = []
    assign = EnginePool.assign

    def recording_assign(pool: EnginePool, r: Any, request_id: str, request: Any) -> None:
        if pool.name == "rollout":
            starts.append((r.engine.version, runtime.ctx.ledger.start_floor(request.group)))
        assign(pool, r, request_id, request)

    monkeypatch.setattr(EnginePool, "assign", recording_assign)
    return run_virtual(runtime.run()), runtime, starts


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("sigma", [0.0, 1.5])
def test_prompts_wait_for_their_steps_weights_and_none_is_generated_twice(replicas, sigma, monkeypatch):
    s_off, _, starts_off = _run(_config(False, replicas, sigma), monkeypatch)
    s_on, rt, starts = _run(_config(True, replicas, sigma), monkeypatch)
    # without the floor some prompts start on weights their step cannot use and are generated again
    assert any(v < floor for v, floor in starts_off)
    assert s_off["ledger"]["requeued_stale"] > 0
    # with it: every request started on weights at or above its group's floor, none was re-queued as stale
    assert starts and all(v >= floor for v, floor in starts)
    assert max(floor for _, floor in starts) == STEPS - 2  # the last step's prompts wait for its k = 1 weights
    assert s_on["ledger"].get("requeued_stale", 0) == 0
    assert s_on["counters"]["prompts_started"] == STEPS * B
    # the same steps, whole groups, inside the bound, each prompt trained once
    assert s_on["steps"] == STEPS
    hist = {int(lag): n for lag, n in s_on["staleness_histogram"].items()}
    assert sum(hist.values()) == STEPS * B * N and max(hist) <= 1
    assert len(rt.ctx.ledger.trained) == STEPS * B
    # and sooner on the virtual clock: the work saved is the regenerated prompts'
    assert s_on["step_end_s"][-1] < s_off["step_end_s"][-1]


def test_a_held_prompt_leaves_its_replica_to_an_older_prompt_and_goes_to_a_replica_with_its_weights():
    """The dispatch itself: a prompt whose floor no free replica has is held, and the replica it passed over still
    takes the prompts after it that it can serve (in the same dispatch); a replica that has the floor takes it."""
    async def body() -> None:
        stage, ctx = _stage(SilentEngine(), InProcessStore(capacity=8))
        ctx.tail, ctx.version = S.TailPolicy(step_weights=True), 1  # k = 1: every eligible replica has version 0
        stage.guard = S.StalenessGuard(ctx)  # (the guard takes the run's tail policy when made)
        new, old = (ctx.ledger.admit(i, PromptRecord(i, f"q{i}")) for i in range(2))
        new.start_floor = 1  # admitted for step 2: needs the weights of version 1
        first, second = SingleTurn(0, None, (7,), new.group_id), SingleTurn(1, None, (7,), old.group_id)
        stage._pending = [first, second]
        r = stage.replicas[0]
        stage._dispatch()  # the replica is on version 0: the first waits, the second (floor 0) goes
        assert list(r.inflight) == [second.request_id] and stage._pending == [first]
        r.engine.version = 1  # it loaded version 1
        stage._dispatch()
        assert list(r.inflight) == [second.request_id, first.request_id] and stage._pending == []
        await asyncio.sleep(0)
        for t in list(stage._tasks):
            t.cancel()

    asyncio.run(body())
