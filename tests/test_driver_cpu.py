"""benchmarks/driver_cpu.py (CPU per step of the driver's threads and its children) runs and reports what it
claims, and profile_step.py's ``--rank-settings`` refuses a name it does not have.

One short real run of the example (4 steps, window 1..2); the checks are on the report's structure and
consistency, never on timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER_CPU = ROOT / "benchmarks" / "driver_cpu.py"
PROFILE = ROOT / "benchmarks" / "profile_step.py"
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=ENV,
                          timeout=timeout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_driver_cpu_reports_the_driver_threads_and_its_children(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("asyncflow_fsdp")
    before = set(Path(tempfile.gettempdir()).glob("driver_cpu-*"))
    proc = _run(DRIVER_CPU, "--steps", "4", "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["steps_measured"] == res["window"][1] - res["window"][0] >= 1
    assert res["window"][0] >= 1 and res["window"][1] >= 2
    for key in ("wall_ms_per_step", "driver_cpu_ms_per_step", "children_cpu_ms_per_step", "gc_ms_per_step"):
        assert math.isfinite(res[key]) and res[key] >= 0, (key, res[key])
    assert res["wall_ms_per_step"] > 0
    threads = res["threads_cpu_ms_per_step"]
    assert "MainThread" in threads and "driver_cpu-sampler" in threads
    assert all(math.isfinite(v) and v >= 0 for v in threads.values()), threads
    assert set(res["threads_count"]) == set(threads) and res["threads_count"]["MainThread"] == 1
    # the fsdp rank is a child process; a step trains in it and runs the event loop in the driver
    assert res["children"] >= 1 and res["children_cpu_ms_per_step"] > 0
    assert res["driver_cpu_ms_per_step"] > 0
    # the live threads' CPU is part of the process's (one clock tick of rounding per thread at most)
    tick_ms = 1000.0 / res["clock_ticks_per_s"] / res["steps_measured"]
    assert sum(threads.values()) <= res["driver_cpu_ms_per_step"] + tick_ms * (sum(res["threads_count"].values()) + 1)
    # the run directory lived in a temporary directory that is gone
    assert set(Path(tempfile.gettempdir()).glob("driver_cpu-*")) <= before


def test_driver_cpu_refuses_a_window_that_has_no_steady_step():
    proc = _run(DRIVER_CPU, "--steps", "4", "--warmup", "2", timeout=60)
    assert proc.returncode == 2
    assert "--steps >= --warmup + 3" in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_driver_cpu_reports_a_bad_override_in_one_line():
    proc = _run(DRIVER_CPU, "--steps", "4", "--warmup", "1", "trainer.bogus=1", timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "trainer.bogus" in line and "unknown field" in line


def test_driver_cpu_off_linux_says_so_and_exits_2(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import driver_cpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(driver_cpu.sys, "platform", "darwin")
    assert driver_cpu.main(["--steps", "4", "--warmup", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "Linux only" in line and "darwin" in line


def test_rank_settings_refuses_a_bad_name_listing_the_valid_ones():
    proc = _run(PROFILE, "--rank-step", "--rank-settings", "auto+shared,bogus", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "'auto+shared,bogus'" in last
    for name in ("always", "auto", "auto+shared", "floor"):
        assert name in last.split("choose from ")[1]
