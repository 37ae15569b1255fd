"""The flow runtime end to end on the real toy engines (a bigram policy), on a real event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import ConfigError, EngineError
from asyncflow_core.flow.runtime import FlowRuntime, run_flow
from asyncflow_core.flow.stage import RunStopped
from asyncflow_plugins.toy.rollout import ToyRolloutEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"


def toy(*overrides: str):
    return resolve(load_config(EXAMPLE, list(overrides)))


def _accounted(summary: dict) -> None:
    led = summary["ledger"]
    assert led["trained"] + led["dropped"] + led["unfinished"] == led["admitted"]
    assert led["trained"] == summary["samples_trained"] // 4


@pytest.mark.parametrize("mode", ["sync", "one_step", "async"])
def test_every_mode_trains_and_accounts_for_every_prompt(mode, tmp_path):
    extra = ["async.max_staleness=2"] if mode == "async" else []
    s = run_flow(toy(f"async.mode={mode}", "trainer.total_steps=6", *extra), run_dir=tmp_path, write_png=False)
    assert s["steps"] == 6
    assert s["stop_reason"] == "done"
    k = {"sync": 0, "one_step": 1, "async": 2}[mode]
    assert all(int(lag) <= k for lag in s["staleness_histogram"])
    assert sum(s["staleness_histogram"].values()) == 6 * 4 * 4  # B=4 prompts x n=4 samples per step
    _accounted(s)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    if mode == "sync":
        assert s["staleness_histogram"] == {"0": 96}


def test_one_step_runs_ahead_of_training(tmp_path):
    """With k = 1 some rows were generated one version behind the step that used them (the overlap)."""
    s = run_flow(toy("trainer.total_steps=8"), run_dir=tmp_path, write_png=False)
    assert int(s["staleness_histogram"].get("1", 0)) > 0


def test_stream_end_stops_cleanly(tmp_path):
    s = run_flow(toy("data.epochs=1", "trainer.total_steps=50"), run_dir=tmp_path, write_png=False)
    assert s["steps"] == 2  # 8 prompts / 4 per step
    assert s["stop_reason"].startswith("the prompt stream ended")
    _accounted(s)


def test_off_policy_without_correction_is_refused():
    with pytest.raises(ConfigError, match="no off-policy correction"):
        asyncio.run(FlowRuntime(toy("algorithm.options.correction=none")).run())
    # on-policy (sync) it is fine
    s = run_flow(toy("algorithm.options.correction=none", "async.mode=sync", "trainer.total_steps=2"), write_png=False)
    assert s["steps"] == 2


def test_store_too_small_for_the_bound_is_refused():
    with pytest.raises(ConfigError, match="capacity"):
        asyncio.run(FlowRuntime(toy("store.options.capacity=8")).run())


class _FlakyReward:
    """Raises for one prompt: its samples fail, the group is dropped, the run goes on."""

    needs_text = True

    def __init__(self, bad_prompt: str) -> None:
        self.bad = bad_prompt

    def score(self, sample):
        if sample.prompt == self.bad:
            raise ValueError("reward server said no")
        return 1.0


def _with_factory(resolved, section: str, factory):
    comp = resolved.components[section]
    record = dataclasses.replace(comp.registered.record, factory=factory)
    resolved.components[section] = dataclasses.replace(comp, registered=dataclasses.replace(comp.registered, record=record))
    return resolved


def test_a_failing_row_is_dropped_and_the_run_goes_on(tmp_path):
    resolved = _with_factory(toy("trainer.total_steps=4", "pipeline.max_failure_rate=0.5"), "reward",
                             lambda cfg: _FlakyReward("1+1="))
    s = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert s["steps"] == 4
    assert s["ledger"]["dropped"] >= 1
    assert s["ledger"]["dropped_failed"] == s["ledger"]["dropped"]
    assert s["counters"]["failed_reward"] >= 4
    _accounted(s)


def test_failure_rate_limit_stops_the_run_with_the_reason():
    resolved = _with_factory(toy("trainer.total_steps=4", "pipeline.max_failure_rate=0.01"), "reward",
                             lambda cfg: _FlakyReward("1+1="))
    with pytest.raises(RunStopped, match="max_failure_rate.*reward server said no"):
        run_flow(resolved, write_png=False)


class _DyingToy(ToyRolloutEngine):
    """Replica 0 dies after a few results; replica 1 lives."""

    instances = 0

    def __init__(self, config):
        super().__init__(config)
        self.index = _DyingToy.instances
        _DyingToy.instances += 1
        self.results = 0

    async def generate(self, requests):
        async for res in super().generate(requests):
            self.results += 1
            if self.index == 0 and self.results > 6:
                raise EngineError("replica 0 lost its device")
            yield res


def test_a_dead_replica_has_its_requests_requeued(tmp_path):
    _DyingToy.instances = 0
    resolved = _with_factory(toy("trainer.total_steps=5", "rollout.replicas=2", "rollout.rows_per_lease=4"),
                             "rollout", _DyingToy)
    s = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert s["steps"] == 5
    assert s["counters"]["replicas_died"] == 1
    assert s["counters"]["requeued_engine_death"] >= 1
    _accounted(s)


def test_telemetry_files_and_trace_command(tmp_path):
    run_flow(toy("trainer.total_steps=3"), run_dir=tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"rollout/0", "train", "advantage"} <= names
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {"train_step", "generate", "send_weights", "update_weights"} <= {e["name"] for e in spans}
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "again.png"
    proc = subprocess.run([sys.executable, "-m", "asyncflow_core", "trace", str(tmp_path), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("reward_mean", "staleness_histogram", "tokens_per_s", "weight_sync_s", "utilisation", "events"):
        assert key in rec


def test_trace_of_a_directory_without_a_run_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncflow_core", "trace", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "spans.jsonl" in proc.stderr


def test_cli_run_writes_its_run_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncflow_core", "run", str(EXAMPLE), "trainer.total_steps=2",
                           "--run-dir", str(tmp_path / "r"), "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 2
    assert (tmp_path / "r" / "summary.json").is_file()


def test_ctrl_c_stops_cleanly_and_writes_what_was_collected(tmp_path):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "asyncflow_core", "run", str(EXAMPLE), "trainer.total_steps=100000",
                             "data.epochs=100000", "--run-dir", str(tmp_path), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = tmp_path / "metrics.jsonl"
    while time.monotonic() < deadline and (not metrics.is_file() or not metrics.read_text().strip()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "summary.json").is_file()
    assert json.loads((tmp_path / "summary.json").read_text())["stop_reason"] == "interrupted"
