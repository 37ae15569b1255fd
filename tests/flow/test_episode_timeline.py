"""Episodes on the timeline and their per-episode figures: env spans with the turn, the pool's own environment
seconds, ``episode_tool_s`` and ``episode_correct`` (columns and metrics).

A tiny multi-turn run through the rollout stage (the fake token-level engine and helpers of test_episode.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.env_pool import EnvironmentPool
from asyncflow_core.flow.episode import MultiTurnEpisodes
from asyncflow_core.flow.run_report import episode_figures
from asyncflow_core.flow.telemetry import Timeline, load_spans
from asyncflow_core.interfaces.environment import Step
from asyncflow_core.types import Batch
from tests.flow.test_episode import FakeEngine, ScriptEnv, _rows, _run, ep_settings, records

TOOL_S = 0.02  #: what the test environment reports per step as info["tool_seconds"]


class ToolEnv(ScriptEnv):
    """ScriptEnv whose steps report tool seconds, and ``correct`` on the last step for even rows only."""

    async def step(self, action):
        step = await super().step(action)
        info = {**step.info, "tool_seconds": TOOL_S}
        if step.done and self.record["index"] % 2 == 0:
            info["correct"] = float(self.record["index"] % 4 == 0)  # rows 0, 4: 1; rows 2: 0
        return Step(step.observation, reward=step.reward, done=step.done, info=info)


def _env_spans(ctx):
    return [s for s in ctx.timeline.spans if s.lane.startswith("env/")]


def test_each_reset_and_step_is_a_span_on_the_env_lanes_with_row_turn_and_seconds(tmp_path):
    eps = MultiTurnEpisodes(ep_settings(ToolEnv))
    batch, order, ctx, _, _ = asyncio.run(_run(records(5, turns=3), eps, engines=[FakeEngine()], max_inflight=4))
    spans = _env_spans(ctx)
    # every row: one reset and three steps (turns 0, 1, 2), each traced once
    per_row: dict[int, list] = {}
    for s in spans:
        per_row.setdefault(s.args["row"], []).append(s)
    assert sorted(per_row) == sorted(order)
    for row, ss in per_row.items():
        ss.sort(key=lambda s: s.start)
        assert [s.name for s in ss] == ["reset", "step", "step", "step"]
        assert "turn" not in ss[0].args and [s.args["turn"] for s in ss[1:]] == [0, 1, 2]
        assert all(s.args["tool_s"] == TOOL_S for s in ss[1:]) and "tool_s" not in ss[0].args
        assert all(s.args["env_s"] >= 0 for s in ss)
    # no lane holds overlapping spans (concurrent calls take lanes of their own)
    by_lane: dict[str, list] = {}
    for s in spans:
        by_lane.setdefault(s.lane, []).append((s.start, s.end))
    for ivs in by_lane.values():
        ivs.sort()
        assert all(b[0] >= a[1] for a, b in zip(ivs, ivs[1:]))
    # the episode's environment seconds are the sum of its calls' seconds (reset and steps, not the open)
    rows = _rows(batch, order)
    for row, ss in per_row.items():
        assert rows[row][C.EPISODE_ENV_S] == pytest.approx(sum(s.args["env_s"] for s in ss), rel=1e-5)
    # the rollout lane's busy figures are what they were: env spans sit on lanes of their own
    assert {lane for lane in ctx.timeline.lanes() if not lane.startswith("env/")} == {
        s.lane for s in ctx.timeline.spans if not s.lane.startswith("env/")}
    # trace.json and spans.jsonl carry the args
    ctx.timeline.write(tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "step"]
    assert len(steps) == 15 and all({"row", "turn", "env_s", "tool_s"} <= set(e["args"]) for e in steps)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert "env/0" in names
    loaded = [s for s in load_spans(tmp_path) if s.name == "step"]
    assert sorted((s.args["row"], s.args["turn"]) for s in loaded) == sorted((r, t) for r in order for t in range(3))


def test_tool_seconds_and_correct_are_written_per_episode_and_absent_ones_are_nan():
    eps = MultiTurnEpisodes(ep_settings(ToolEnv))
    batch, order, ctx, _, _ = asyncio.run(_run(records(6, turns=2), eps, engines=[FakeEngine()]))
    rows = _rows(batch, order)
    for row, r in rows.items():
        assert r[C.EPISODE_TOOL_S] == pytest.approx(2 * TOOL_S, rel=1e-6)
        if row % 2:
            assert math.isnan(r[C.EPISODE_CORRECT])  # the environment did not report it
        else:
            assert r[C.EPISODE_CORRECT] == float(row % 4 == 0)
    # an environment that reports neither: NaN in both
    batch, order, _, _, _ = asyncio.run(_run(records(2, turns=2), MultiTurnEpisodes(ep_settings(ScriptEnv)),
                                            engines=[FakeEngine()]))
    for r in _rows(batch, order).values():
        assert math.isnan(r[C.EPISODE_TOOL_S]) and math.isnan(r[C.EPISODE_CORRECT])


def test_episode_figures_average_tool_seconds_and_correct_over_the_episodes_that_report_them():
    nan = math.nan
    batch = Batch({
        C.EPISODE_TURNS: torch.tensor([2, 3, 1, 2]),
        C.EPISODE_TOOL_S: torch.tensor([0.5, nan, 1.5, nan]),
        C.EPISODE_CORRECT: torch.tensor([1.0, 0.0, nan, 1.0]),
    })
    out = episode_figures(batch)
    assert out["turns"] == pytest.approx(2.0)
    assert out["tool_s"] == pytest.approx(1.0)  # (0.5 + 1.5) / 2: the unreported rows do not count as 0
    assert out["correct"] == pytest.approx(2 / 3)
    none = episode_figures(Batch({C.EPISODE_TURNS: torch.tensor([1, 1]),
                                  C.EPISODE_CORRECT: torch.tensor([nan, nan])}))
    assert "correct" not in none and "tool_s" not in none


def test_env_seconds_in_a_worker_process_are_measured_there(tmp_path):
    """The pool's timing of a worker's call is the worker's own: the step blocks its worker ~0.05 s; the timing
    covers that and is never more than the await around it (pipe and loop latency are not in it)."""
    from asyncflow_core.interfaces.environment import Action
    from tests.envs.env_fixtures import make_scripted

    async def main():
        async with EnvironmentPool(make_scripted, step_timeout_s=30.0, workers=2, processes=1) as pool:
            env = await pool.open()
            await env.reset({"mode": "wait_file", "at": 0, "path": str(tmp_path / "never"), "bound_s": 0.05},
                            seed=0)
            t0 = time.perf_counter()
            await env.step(Action(token_ids=(1,), text="a", finish_reason="stop", turn=0))
            outer = time.perf_counter() - t0
            await env.close()
            return env.timings, outer

    timings, outer = asyncio.run(main())
    step = [t for t in timings if t.call == "step"][0]
    assert 0.05 <= step.seconds <= outer


def test_guess_reports_tool_seconds_and_correct_on_every_step_and_sleeps_step_delay_s():
    from asyncflow_core.interfaces.environment import Action
    from asyncflow_plugins.envs.guess import GuessEnvConfig, GuessEnvironment

    with pytest.raises(ValueError):
        GuessEnvConfig(step_delay_s=(0.2, 0.1))
    env = GuessEnvironment(GuessEnvConfig(step_delay_s=(0.03, 0.04)))

    async def main():
        await env.reset({"prompt": "=", "answer": "2"}, seed=1)
        turns = ["4.", "x.", "2."]
        return [await env.step(Action(token_ids=(), text=t, finish_reason="stop", turn=i))
                for i, t in enumerate(turns)]

    steps = asyncio.run(main())
    assert [s.info["correct"] for s in steps] == [0.0, 0.0, 1.0]
    assert all(s.info["tool_seconds"] >= 0.03 for s in steps)  # the delay is awaited inside the step


def test_slot_spans_are_capped_so_a_long_run_stays_cheap(monkeypatch):
    import itertools

    from asyncflow_core.flow import telemetry

    monkeypatch.setattr(telemetry, "MAX_SLOT_SPANS", 3)
    ticks = itertools.count()
    tl = telemetry.Timeline(lambda: float(next(ticks)))
    for turn in range(5):
        with tl.slot_span("env", "step", {"turn": turn}) as args:
            args["tool_s"] = 0.0  # the caller still gets its args past the cap
    assert [s.args["turn"] for s in tl.spans if s.lane.startswith("env/")] == [0, 1, 2]
