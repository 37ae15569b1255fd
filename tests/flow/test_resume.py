"""Checkpoints and ``--resume`` on the real toy engines: no prompt trained twice, none skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.checkpoint import latest_checkpoint
from asyncflow_core.flow.runtime import run_flow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"
B = 4  # prompts per step in the example


def toy(*overrides: str):
    return resolve(load_config(EXAMPLE, list(overrides)))


def _trained(run_dir: Path) -> list[int]:
    return latest_checkpoint(run_dir)[1].trained


def test_sync_resume_trains_exactly_the_prompts_an_unbroken_run_trains(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    common = ["async.mode=sync", "trainer.checkpoint_every=2", "data.shuffle=true"]
    run_flow(toy(*common, "trainer.total_steps=8"), run_dir=whole, write_png=False)
    first = run_flow(toy(*common, "trainer.total_steps=4"), run_dir=part, write_png=False)
    assert first["steps"] == 4
    second = run_flow(toy(*common, "trainer.total_steps=8"), run_dir=part, write_png=False, resume=True)
    assert second["steps"] == 8
    # k = 0: every step trains the next B prompts of the seeded order, so the sets must match exactly
    assert _trained(part) == _trained(whole)
    assert len(_trained(part)) == 8 * B
    steps = [json.loads(line)["step"] for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # appended, numbering continued
    assert sorted(p.name for p in (part / "checkpoints").glob("step_*")) == ["step_000006", "step_000008"]


def test_one_step_resume_repeats_nothing_and_skips_nothing(tmp_path):
    run = tmp_path / "run"
    common = ["trainer.checkpoint_every=3", "data.shuffle=true"]
    run_flow(toy(*common, "trainer.total_steps=3"), run_dir=run, write_png=False)
    before = set(_trained(run))
    s = run_flow(toy(*common, "trainer.total_steps=9"), run_dir=run, write_png=False, resume=True)
    after = _trained(run)
    assert len(after) == len(set(after)) == 9 * B
    assert before < set(after)
    # prompts in flight at the checkpoint were generated again, not skipped: with k = 1 the trained prompts are
    # the first (9 + at most 1 step) x B positions of the order, no holes beyond one step's look-ahead
    assert max(after) < (9 + 2) * B
    assert all(int(lag) <= 1 for lag in s["staleness_histogram"])


def test_resume_refuses_a_changed_data_order(tmp_path):
    run = tmp_path / "run"
    run_flow(toy("trainer.checkpoint_every=2", "trainer.total_steps=2"), run_dir=run, write_png=False)
    with pytest.raises(ConfigError, match="data order changed"):
        run_flow(toy("trainer.checkpoint_every=2", "trainer.total_steps=4", "seed=7"), run_dir=run,
                 write_png=False, resume=True)


def test_resume_without_checkpoint_says_why(tmp_path):
    run = tmp_path / "run"
    run_flow(toy("trainer.total_steps=2"), run_dir=run, write_png=False)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        run_flow(toy("trainer.total_steps=4"), run_dir=run, write_png=False, resume=True)


def test_cli_resume(tmp_path):
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "asyncflow_core"]
    first = subprocess.run([*cli, "run", str(EXAMPLE), "trainer.total_steps=2", "trainer.checkpoint_every=2",
                            "--run-dir", str(run), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert (run / "config.yaml").is_file() and (run / "reward.png").is_file()
    again = subprocess.run([*cli, "run", "--resume", str(run), "trainer.total_steps=4", "--no-progress"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["steps"] == 4
    bad = subprocess.run([*cli, "run", "--resume", str(tmp_path / "nowhere"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "no config.yaml" in bad.stderr and "Traceback" not in bad.stderr
