"""The multi-turn example (examples/agent_guess.yaml) under the ray launcher: rollout replicas and the trainer as
Ray actors, environments in the driver's episode tasks. Two steps through `asyncflow run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
ASYNCFLOW = str(Path(sys.executable).parent / "asyncflow")


@pytest.mark.slow
def test_the_multi_turn_example_runs_under_ray(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [ASYNCFLOW, "run", "examples/agent_guess.yaml", "launcher.name=ray", "trainer.total_steps=2",
         "trainer.checkpoint_every=0", "data.prompts_per_step=8", "--run-dir", str(run), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "episode/turns" in r]
    assert len(steps) == 2 and max(r["episode/turns"] for r in steps) > 1
    assert all(0 < r["episode/masked_frac"] < 1 for r in steps)
    assert all(int(lag) <= 1 for r in steps for lag in r["staleness_histogram"])  # one_step: k = 1
