"""Tail policies (issue 19): over-provisioned admission, a request-start staleness basis, settling stale tails.

Every run here is the real runtime and store on the simulated engines, seeded, with long-tailed responses
(sigma 1.5) so tails outlive their window. Each must report 0 rows over the bound it declares (the trainer
asserts the bound on every step's rows; the histogram is checked again here), and the ledger must account for
every admitted prompt: trained once, dropped with a reason, or unfinished at the stop, never trained twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncflow_core.config.loader import resolve
from asyncflow_core.config.models import RunConfig
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.clock import run_virtual
from asyncflow_core.flow.runtime import FlowRuntime
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.flow.trajectory_writer import TrajectoryWriter
from asyncflow_plugins.sim.rollout import FEATURES, SimRolloutEngine

B, N, STEPS = 6, 4, 6


def _config(*, k: int = 1, correction: str = "truncated_is", stale_policy: str = "requeue",
            **tail: Any) -> RunConfig:
    async_cfg: dict[str, Any] = {"mode": "one_step" if k == 1 else "async", "stale_policy": stale_policy, **tail}
    if k != 1:
        async_cfg["max_staleness"] = k
    return RunConfig.model_validate({
        "seed": 3,
        "data": {"name": "sim", "options": {"size": 400, "prompt_tokens": 64}, "prompts_per_step": B},
        "rollout": {"name": "sim", "replicas": 3, "n": N, "max_new_tokens": 4096, "max_inflight": 16,
                    "rows_per_lease": 8,
                    "options": {"payload": "lengths", "lengths": {"median_tokens": 200, "sigma": 1.5}}},
        "trainer": {"name": "sim", "options": {"latency": {"devices": 1}}, "total_steps": STEPS},
        "weight_transport": {"name": "sim"},
        "algorithm": {"name": "grpo", "options": {"group_size": N, "correction": correction}},
        "reward": {"name": "sim"},
        "async": async_cfg,
        "logging": {"level": "WARNING"},
    })


def _run(cfg: RunConfig) -> tuple[dict, FlowRuntime, list[tuple[int, int]]]:
    """The run's summary, its runtime, and (trainer version, prompts started net of drops) sampled every 0.5 s."""
    runtime = FlowRuntime(resolve(cfg), write_png=False)
    seen: list[tuple[int, int]] = []

    async def main() -> dict:
        async def watch() -> None:
            while True:
                await asyncio.sleep(0.5)
                if runtime.ctx is not None:
                    seen.append((runtime.ctx.version, runtime.ctx.ledger.net_started))

        task = asyncio.ensure_future(watch())
        try:
            return await runtime.run()
        finally:
            task.cancel()

    return run_virtual(main()), runtime, seen


def _check_accounting(summary: dict, runtime: FlowRuntime, k: int) -> None:
    """0 rows over the bound, and every admitted prompt trained once, dropped, or unfinished."""
    assert summary["steps"] == STEPS
    hist = {int(lag): n for lag, n in summary["staleness_histogram"].items()}
    assert sum(hist.values()) == STEPS * B * N  # every trained row is in the histogram
    assert max(hist) <= k, hist  # 0 violations of the declared bound
    led = runtime.ctx.ledger
    assert len(led.trained) == STEPS * B  # whole groups, each prompt once (mark_trained refuses a second time)
    assert not set(led.trained) & set(led.dropped)
    assert led.admitted == len(led.trained) + len(led.dropped) + led.outstanding
    assert led.outstanding == len(led.groups) + len(led.requeue)  # the unfinished are live or waiting, not lost


def test_default_is_the_exact_bound_with_nothing_extra():
    tail = S.TailPolicy.from_config(_config().async_)
    assert tail == S.TailPolicy() and tail.extra_prompts(B) == 0
    assert S.admission_limit(2, 1, B) == 4 * B


def test_config_refuses_tail_options_that_cannot_apply():
    with pytest.raises(ValueError, match="need max_staleness >= 1"):
        RunConfig.model_validate({"async": {"mode": "sync", "overprovision": 0.5}})
    with pytest.raises(ValueError, match="need max_staleness >= 1"):
        RunConfig.model_validate({"async": {"mode": "sync", "staleness_basis": "request_start"}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"async": {"mode": "one_step", "overprovision": -0.1}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"async": {"mode": "one_step", "stale_tail": "keep"}})
    # request_start trains mixed-version rows: the loss must be decoupled PPO
    with pytest.raises(ConfigError, match="correction: decoupled"):
        FlowRuntime(resolve(_config(staleness_basis="request_start"))).plan()


def test_store_capacity_check_counts_the_overprovisioned_rows():
    cfg = _config(overprovision=1.0)
    cfg.store.options = {"capacity": (1 + 2) * B * N}  # enough for the bound, not for the extra B prompts
    with pytest.raises(ConfigError, match="overprovision"):
        run_virtual(FlowRuntime(resolve(cfg), write_png=False).run())


def test_partial_rollout_continues_aborted_requests_on_new_weights(monkeypatch):
    """An engine that cannot load weights in flight pauses (aborting what runs) for every update: each aborted
    request resumes after its tokens on the new weights (``resumed_partial``), the row keeps every token with
    its own version, and the bound is still counted on the oldest token."""
    no_inflight = FEATURES.model_copy(update={"supports_inflight_weight_update": False})
    monkeypatch.setattr(SimRolloutEngine, "features", property(lambda self: no_inflight))
    versions: list[tuple[int, ...]] = []
    result_columns = TrajectoryWriter._result_columns

    def spy(self, items):  # every written row's per-token versions
        versions.extend(tuple(int(x) for x in res.versions) for _, res in items if res is not None)
        return result_columns(self, items)

    monkeypatch.setattr(TrajectoryWriter, "_result_columns", spy)
    summary, runtime, _ = _run(_config())
    _check_accounting(summary, runtime, 1)
    assert summary["counters"].get("resumed_partial", 0) > 0
    assert summary["counters"].get("paused_for_update", 0) > 0
    assert any(len(set(v)) > 1 for v in versions)  # rows whose tokens span two versions
    assert all(list(v) == sorted(v) for v in versions)  # a resumed part is never on older weights here


def test_overprovisioned_admission_starts_extra_prompts_and_keeps_the_bound():
    base, rt_base, seen_base = _run(_config())
    over, rt_over, seen_over = _run(_config(overprovision=1.0))
    extra = S.TailPolicy(overprovision=1.0).extra_prompts(B)
    assert extra == B
    for seen, more in ((seen_base, 0), (seen_over, extra)):
        # never more started than the formula allows at the version of the moment
        assert all(started <= S.admission_limit(v, 1, B, more) for v, started in seen)
    # the over-provisioned run really ran ahead of the exact bound's admission, the exact one never did
    assert any(started > S.admission_limit(v, 1, B) for v, started in seen_over if started < STEPS * B)
    assert not any(started > S.admission_limit(v, 1, B) for v, started in seen_base)
    _check_accounting(base, rt_base, 1)
    _check_accounting(over, rt_over, 1)
    # the tails went to later steps: rows one version old were trained, and groups outlived the bound
    assert over["staleness_histogram"].get("1", 0) > 0
    assert over["ledger"].get("requeued_stale", 0) > 0


def test_settling_stale_tails_requeues_their_groups_without_generating_them_again():
    restart, rt_restart, _ = _run(_config())
    settle, rt_settle, _ = _run(_config(stale_tail="settle_group"))
    _check_accounting(restart, rt_restart, 1)
    _check_accounting(settle, rt_settle, 1)
    assert restart["counters"].get("requeued_stale_rollout", 0) > 0  # the workload has stale tails
    assert settle["counters"].get("settled_stale_tail", 0) > 0
    assert settle["counters"].get("requeued_stale_rollout", 0) == 0  # none restarted for a doomed group
    assert settle["ledger"].get("requeued_stale", 0) > 0  # their groups came back as new groups


def test_request_start_basis_keeps_its_bound_with_decoupled_ppo():
    cfg = _config(k=2, correction="decoupled", staleness_basis="request_start", overprovision=0.5)
    summary, runtime, _ = _run(cfg)
    _check_accounting(summary, runtime, 2)


def test_request_start_gives_the_exact_schedule_when_first_tokens_come_on_the_start_weights():
    """On this workload every request's first token is sampled on the weights it was submitted to (replicas
    admit at once and load versions in flight), so counting from the start is counting from the oldest token:
    the same decisions. (A request that waits in an engine's queue across an update makes the start basis
    stricter: docs/performance.md, "Tail policies".)"""
    start, _, _ = _run(_config(k=2, correction="decoupled", staleness_basis="request_start"))
    exact, _, _ = _run(_config(k=2, correction="decoupled"))
    assert int(exact["staleness_histogram"].get("2", 0)) > 0 and exact["counters"].get("aborted_stale", 0) > 0
    assert {k: v for k, v in start.items() if k != "wall_seconds"} == \
        {k: v for k, v in exact.items() if k != "wall_seconds"}


def test_request_start_counts_from_the_first_start_across_resumes():
    run = type("Run", (), {"version": 5, "k": 1, "tail": S.TailPolicy(basis=S.REQUEST_START)})()
    guard = S.StalenessGuard(run)
    # started on version 3, resumed on version 5 weights: its tokens are 4 and 5, its start 3 (outside v - k = 4)
    req = SingleTurn(0, None, (1,), 0, origin_version=3, start_version=4)
    assert guard.counted_version(4, 3) == 3
    assert guard.to_abort({"r": req}) == ["r"]
    exact = S.StalenessGuard(type("Run", (), {"version": 5, "k": 1})())
    assert exact.counted_version(4, 3) == 4 and exact.to_abort({"r": req}) == []
    # a request whose tokens are thrown away starts afresh: its start is taken again at the next dispatch
    req.retry_turn()
    assert req.origin_version is None
