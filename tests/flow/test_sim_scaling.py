"""benchmarks/sim_scaling.py: its ideal is a bound every mode stays under, and its rows account for every sample."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from asyncflow_core.flow.runtime import _steady_rate

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("sim_scaling", REPO / "benchmarks" / "sim_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_scaling"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_steady_rate_excludes_the_first_step():
    # steps end at 10 s (pipeline fill), 14 s and 18 s with 8 samples each: 16 samples in 8 s
    assert _steady_rate([(10.0, 8), (14.0, 8), (18.0, 8)]) == pytest.approx(2.0)
    assert _steady_rate([(10.0, 8)]) is None


def test_measured_rate_skips_the_warm_up():
    sim = _load()
    assert sim.warmup_steps("sync") == 1 and sim.warmup_steps("async4") == 5
    # steps end at 10, 11, 14, 17 s; warm-up 2 steps: 2 steps x 8 samples in 6 s
    assert sim.measured_rate([10.0, 11.0, 14.0, 17.0], 2, 8) == pytest.approx(16 / 6)
    with pytest.raises(ValueError):
        sim.measured_rate([10.0, 11.0], 2, 8)


def test_ideal_is_a_bound_and_no_mode_violates_staleness(capsys):
    sim = _load()
    assert sim.main(["--devices", "16", "--modes", "sync,stream,one_step,async2", "--steps", "3",
                     "--samples-per-device", "8", "--max-new-tokens", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in out["results"]}
    assert set(rows) == {"sync", "stream", "one_step", "async2"}
    for r in rows.values():
        assert r["violations"] == 0, r["staleness_histogram"]
        assert r["samples_trained"] == (r["warmup_steps"] + 3) * 16 * 8
        assert 0 < r["efficiency_vs_ideal"] <= 1.0, (r["mode"], r["efficiency_vs_ideal"])
    assert rows["sync"]["speedup_vs_sync"] == pytest.approx(1.0)
    # the overlap bound is built from the stream run: stream sits below it (its phases run one after the other)
    assert rows["stream"]["vs_overlap_bound"] < 1.0


def test_bad_arguments_are_refused(capsys):
    sim = _load()
    with pytest.raises(SystemExit):
        sim.main(["--devices", "12"])
    assert "multiples of 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main(["--modes", "fast"])
    assert "unknown modes" in capsys.readouterr().err


def test_a_pool_starts_the_longest_rows_first_and_reports_them_in_the_order_asked(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # spawned workers import the script by its module name
    sim = _load()
    jobs = [(d, m, 4) for d in (32, 128, 512, 1024) for m in sim.MODES]
    order = sorted(jobs, key=sim.expected_cost, reverse=True)
    assert order[0][:2] == (1024, "async4") and order[-1][:2] == (32, "stream")  # ties keep the order asked
    assert [j[0] for j in order[:5]] == [1024] * 5
    # the pool's rows are the serial run's (same schedule), in the order asked, whatever finished first
    args = ["--devices", "16,24", "--modes", "stream,sync", "--steps", "1", "--samples-per-device", "8",
            "--max-new-tokens", "512", "--json"]
    assert sim.main(args) == 0
    serial = json.loads(capsys.readouterr().out)["results"]
    assert sim.main([*args, "--workers", "2"]) == 0
    pooled = json.loads(capsys.readouterr().out)["results"]
    assert [(r["devices"], r["mode"]) for r in pooled] == [(16, "stream"), (16, "sync"), (24, "stream"),
                                                          (24, "sync")]
    assert [r["schedule_digest"] for r in pooled] == [r["schedule_digest"] for r in serial]
    assert all(r["speedup_vs_sync"] > 0 for r in pooled)  # each size's comparisons were added
