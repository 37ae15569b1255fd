"""The benchmark scripts run and report what they claim: benchmarks/profile_step.py (the per-step profile).

A real run of the example's model (0.1M parameters) for a few steps; the
checks are on the structure and consistency of the report, never on timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "profile_step.py"

pytest.importorskip("transformers")
pytest.importorskip("asyncflow_fsdp")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    png = out / "split.png"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "0.1M", "--steps", "2", "--json", "--png", str(png),
         "--out", str(out / "runs")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), png


def test_every_phase_is_reported_and_the_exclusive_split_fits_in_the_step(profile):
    report, _ = profile
    phases = report["phases"]
    assert set(phases) >= {"generate", "reward", "old_ref_logprobs", "train_forward", "train_backward",
                           "train_optimizer", "train_ipc", "weight_export", "weight_transfer", "weight_load",
                           "checkpoint", "store", "idle"}
    (res,) = report["results"]
    assert res["size"] == "0.1M" and res["steps_measured"] == 2 and len(res["steps"]) == 2
    for step in res["steps"]:
        split = step["phases_s"]
        assert set(split) == set(phases)
        assert all(v >= 0.0 for v in split.values()), split
        total = sum(split.values())
        # the exclusive split covers the window exactly: float rounding only (one ulp-ish per piece)
        assert total <= step["step_s"] * (1 + 1e-9) + 1e-12, (total, step["step_s"])
        assert total == pytest.approx(step["step_s"], rel=1e-9, abs=1e-12)
        busy = step["busy_s"]
        assert all(v >= 0.0 for v in busy.values()), busy
        assert all(v <= step["step_s"] * (1 + 1e-9) for v in busy.values()), busy  # a union fits its window
        # the trainer ran in every measured step and its rank-side pieces were probed
        assert split["train_forward"] > 0 and split["train_backward"] > 0 and split["train_optimizer"] > 0
        assert split["checkpoint"] > 0  # checkpoint_every defaults to 1
        assert busy["weight_export"] > 0 and busy["store"] > 0
    assert res["phases_s"].keys() == set(phases)
    assert res["samples_per_s"] > 0 and res["params"] > 0
    rss = res["peak_rss_mb"]
    assert rss["driver"] > 0 and rss.get("rank0", 0) > 0, rss
    assert res["rank_ops"]["train"]["calls"] >= 2 + 1  # warm-up and measured steps at least


def test_the_chart_is_written(profile):
    _, png = profile
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_exclusive_split_prefers_the_trainer_and_counts_gaps_as_idle():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from profile_step import split_window
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    intervals = [("generate", 0.0, 6.0), ("train_ipc", 1.0, 5.0), ("train_backward", 2.0, 3.0),
                 ("store", 5.5, 7.0), ("reward", 8.0, 9.0)]
    exclusive, busy = split_window(intervals, 0.0, 10.0)
    assert exclusive["train_backward"] == 1.0
    assert exclusive["train_ipc"] == 3.0  # 1..5 less the backward second
    assert exclusive["generate"] == 1.5  # 0..1 and 5..5.5: the rest is under the trainer or the store
    assert exclusive["store"] == 1.5
    assert exclusive["reward"] == 1.0
    assert exclusive["idle"] == 2.0  # 7..8 and 9..10
    assert sum(exclusive.values()) == 10.0
    assert busy["generate"] == 6.0 and busy["train_backward"] == 1.0
    assert busy["train_ipc"] == 3.0  # its own time: the nested backward is not counted twice
