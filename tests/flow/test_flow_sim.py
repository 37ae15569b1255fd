"""The flow runtime driving the simulated engines on the virtual clock: modes, accounting, the staleness bound."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_core.config.loader import resolve
from asyncflow_core.config.models import RunConfig
from asyncflow_core.flow.runtime import run_flow


def sim_config(mode: str = "one_step", k: int | None = None, *, replicas: int = 4, steps: int = 4, prompts: int = 8,
               n: int = 4, colocated: bool | None = None, rollout_latency: dict | None = None,
               lengths: dict | None = None, trainer_devices: int = 8, policy: str = "requeue",
               max_new: int = 2048, size: int | None = None) -> RunConfig:
    async_cfg = {"mode": mode, "stale_policy": policy}
    if k is not None:
        async_cfg["max_staleness"] = k
    if colocated is not None:
        async_cfg["colocated"] = colocated
    return RunConfig.model_validate({
        "data": {"name": "sim", "options": {"size": size or prompts * (steps + 6), "prompt_tokens": 64},
                 "prompts_per_step": prompts},
        "rollout": {"name": "sim", "replicas": replicas, "n": n, "max_new_tokens": max_new, "max_inflight": 64,
                    "rows_per_lease": 16,
                    "options": {"latency": rollout_latency or {}, "lengths": lengths or {"median_tokens": 300}}},
        "trainer": {"name": "sim", "options": {"latency": {"devices": trainer_devices}}, "total_steps": steps},
        "weight_transport": {"name": "sim"},
        "algorithm": {"name": "grpo", "options": {"group_size": n}},
        "reward": {"name": "sim"},
        "async": async_cfg,
        "logging": {"level": "WARNING"},
    })


def _check(summary: dict, k: int, steps: int, prompts: int, n: int) -> None:
    assert summary["steps"] == steps, summary["stop_reason"]
    hist = {int(lag): c for lag, c in summary["staleness_histogram"].items()}
    assert all(lag <= k for lag in hist), hist  # the bound, on every row trained
    assert sum(hist.values()) == steps * prompts * n
    led = summary["ledger"]
    assert led["trained"] == steps * prompts  # every step trained on B whole groups
    assert led["trained"] + led["dropped"] + led["unfinished"] == led["admitted"]


@pytest.mark.parametrize("mode,k,colocated", [("sync", 0, True), ("sync", 0, False), ("one_step", 1, None),
                                              ("async", 3, None)])
def test_each_mode_accounts_for_every_prompt(mode, k, colocated):
    s = run_flow(resolve(sim_config(mode, k if mode == "async" else None, colocated=colocated)), virtual=True,
                 write_png=False)
    _check(s, k, 4, 8, 4)
    if mode != "sync":
        assert int(s["staleness_histogram"].get("1", 0)) > 0  # rollout really ran ahead of training


def test_drop_policy_counts_what_it_drops():
    # very long tails and k = 1: some groups miss the bound and are dropped (not re-queued)
    s = run_flow(resolve(sim_config("one_step", lengths={"median_tokens": 300, "sigma": 1.6}, max_new=8192,
                                    policy="drop", steps=5)), virtual=True, write_png=False)
    _check(s, 1, 5, 8, 4)
    assert s["ledger"]["dropped"] == s["ledger"].get("dropped_stale", 0) + s["ledger"].get("dropped_failed", 0)


def test_delayed_update_beats_sync_on_the_simulated_clock():
    sync = run_flow(resolve(sim_config("sync", replicas=4, steps=5)), virtual=True, write_png=False)
    one = run_flow(resolve(sim_config("one_step", replicas=4, steps=5)), virtual=True, write_png=False)
    assert one["samples_per_s"] > 1.1 * sync["samples_per_s"]


def test_hours_of_simulated_training_cost_events_not_decoding_passes():
    """Slow simulated hardware (one trainer device, 150 ms passes): hours of simulated time, little real work.

    What a simulation costs is its scheduler events (arrivals, completions,
    aborts, weight updates), not its decoding passes: the clock jumps over
    every run of passes in which nothing happens. The wall-time figure lives
    in benchmarks/sim_scaling.py (docs/performance.md), not in a test.
    """
    from asyncflow_core.flow.clock import run_virtual
    from asyncflow_core.flow.runtime import FlowRuntime, Roles

    class Keep(Roles):
        def __init__(self) -> None:
            super().__init__()
            self.rollout: list = []

        def build(self, section, factory, options, *, role, index=0):
            obj = factory(options)
            if section == "rollout":
                self.rollout.append(obj)
            return obj

    roles = Keep()
    cfg = sim_config("one_step", replicas=4, steps=10, prompts=8, trainer_devices=1,
                     rollout_latency={"step_overhead_s": 0.15}, lengths={"median_tokens": 1500, "sigma": 0.9},
                     max_new=8192)
    s = run_virtual(FlowRuntime(resolve(cfg), write_png=False, roles=roles).run())
    _check(s, 1, 10, 8, 4)
    assert s["run_seconds"] > 1.5 * 3600  # hours of simulated time...
    passes = sum(e.stats.steps for e in roles.rollout)
    events = sum(e.stats.events for e in roles.rollout)
    assert len(roles.rollout) == 4 and passes > 0
    # ...for far fewer scheduler intervals than decoding passes: passes are integrated, not stepped one by one
    assert events * 20 < passes, (events, passes)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 3),
    replicas=st.integers(1, 5),
    per_seq_ms=st.floats(0.01, 2.0),
    overhead_ms=st.floats(0.5, 20.0),
    median=st.floats(20, 2000),
    sigma=st.floats(0.0, 1.8),
    trainer_devices=st.sampled_from([1, 8, 64]),
    policy=st.sampled_from(["requeue", "drop"]),
)
def test_random_engine_speeds_and_lengths_never_break_the_bound(k, replicas, per_seq_ms, overhead_ms, median, sigma,
                                                                trainer_devices, policy):
    mode = {0: "sync", 1: "one_step"}.get(k, "async")
    cfg = sim_config(mode, k if mode == "async" else None, replicas=replicas, steps=4, prompts=4, n=2,
                     colocated=False if k == 0 else None, trainer_devices=trainer_devices, policy=policy,
                     rollout_latency={"per_seq_s": per_seq_ms / 1000, "step_overhead_s": overhead_ms / 1000},
                     lengths={"median_tokens": median, "sigma": sigma}, max_new=4096, size=400)
    s = run_flow(resolve(cfg), virtual=True, write_png=False)
    _check(s, k, 4, 4, 2)


def test_a_late_weight_transfer_is_an_error_with_its_reason_not_a_hang():
    from asyncflow_core.errors import WeightTransferError

    cfg = sim_config("one_step").model_copy(deep=True)
    cfg.weight_transport.deadline_s = 0.5  # a simulated 7B send takes ~0.86 s
    with pytest.raises(WeightTransferError, match="deadline"):
        run_flow(resolve(cfg), virtual=True, write_png=False)
