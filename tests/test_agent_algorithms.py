"""Every built-in algorithm trains on multi-turn episodes: examples/agent_guess.yaml for 2 steps with PPO (the
fsdp engine's value head), RLOO and REINFORCE++ (GRPO: tests/test_agent_example.py), torch rollout, fsdp trainer.

What the trainer receives is recorded: episodes of more than one turn with
observed tokens masked; PPO's rows carry per-token values from the engine's
value head and their returns, and its value loss is reported; each step's loss and gradient are
finite, the gradient is not zero, and the run keeps the staleness bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.runtime import run_flow  # noqa: E402
from asyncflow_fsdp.engine import FSDPTrainEngine  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_guess.yaml"
STEPS, PROMPTS, N = 2, 8, 8
PINNED = ("rollout.options.device=cpu", "trainer.options.device=cpu", "trainer.options.mixed_precision=float32",
          f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=0", f"data.prompts_per_step={PROMPTS}")
ALGORITHMS = {
    "ppo": ["algorithm.name=ppo", "algorithm.options={entropy_coef: 0.02}", "trainer.options.value_head=true"],
    "rloo": ["algorithm.name=rloo", "algorithm.options={group_size: 8, entropy_coef: 0.02}"],
    "reinforce_pp": ["algorithm.name=reinforce_pp", "algorithm.options={baseline: group_mean, entropy_coef: 0.02}"],
}


class RecordingTrainer(FSDPTrainEngine):
    """The fsdp engine, keeping what each trained row held: its loss mask, turns and (PPO) values and returns."""

    rows: list[dict] = []

    async def train_step(self, batch, algorithm):
        for i in range(batch.num_rows):
            row = {"mask": batch[C.LOSS_MASK][i].tolist(), "turns": int(batch[C.EPISODE_TURNS][i]),
                   "advantages": batch[C.ADVANTAGES][i].tolist()}
            for col in (C.VALUES, C.RETURNS):
                if col in batch.columns:
                    row[col] = batch[col][i].tolist()
            type(self).rows.append(row)
        return await super().train_step(batch, algorithm)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_agent_example_trains_with_each_algorithm(name, tmp_path):
    resolved = resolve(load_config(EXAMPLE, [*PINNED, *ALGORITHMS[name]]))
    resolved = resolved.with_factory("trainer", RecordingTrainer)
    RecordingTrainer.rows = []
    summary = run_flow(resolved, run_dir=tmp_path / "run", write_png=False)
    assert summary["steps"] == STEPS and summary["stop_reason"] == "done"
    assert all(int(lag) <= 1 for lag in summary["staleness_histogram"])

    rows = RecordingTrainer.rows
    assert len(rows) == STEPS * PROMPTS * N
    assert max(r["turns"] for r in rows) > 1, "no episode took more than one turn"
    assert sum(r["mask"].count(False) for r in rows) > 0, "no observed (masked) token reached the trainer"
    for r in rows:
        assert len(r["advantages"]) == len(r["mask"]) and all(math.isfinite(a) for a in r["advantages"])
    if name == "ppo":  # per-token values over the episode (the head's, at the step's start) and GAE returns
        for r in rows:
            assert len(r[C.VALUES]) == len(r[C.RETURNS]) == len(r["mask"])
            assert all(math.isfinite(v) for v in r[C.VALUES] + r[C.RETURNS])
        # (one_step: both steps' rows may be scored before the first update, by the zero-initialised head)
    else:
        assert all(C.VALUES not in r for r in rows)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "episode/masked_frac" in r]
    assert len(steps) == STEPS
    for r in steps:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0, r
        assert r["episode/masked_frac"] > 0
    if name == "ppo":  # the value loss over the model tokens trains the head
        losses = [r["train/algo/value_loss"] for r in steps]
        assert all(math.isfinite(v) for v in losses) and max(losses) > 0, losses
