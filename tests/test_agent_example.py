"""The multi-turn example (examples/agent_guess.yaml) for a few steps on real engines: torch rollout, fsdp trainer.

What the trainer receives is recorded: episodes take more than one turn;
every token with loss mask 0 is one of the environment's feedback marks,
placed right after a sampled turn, and the feedback is what the guess game
answers to those turns (so observed tokens are exactly the environment's and
the policy's tokens are exactly its own); the masked fraction the metrics
report is the one in the batches; no staleness violation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.runtime import run_flow  # noqa: E402
from asyncflow_fsdp.engine import FSDPTrainEngine  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_guess.yaml"
ALPHABET = "0123456789<>?=."
STEPS = 4
PINNED = ("rollout.options.device=cpu", "trainer.options.device=cpu", "trainer.options.mixed_precision=float32")


class RecordingTrainer(FSDPTrainEngine):
    """The fsdp engine, keeping each trained row's response text, loss mask and turn count."""

    rows: list[tuple[str, list[bool], int]] = []

    async def train_step(self, batch, algorithm):
        ids, mask = batch[C.RESPONSE_IDS], batch[C.LOSS_MASK]
        turns = batch[C.EPISODE_TURNS].tolist()
        for i in range(batch.num_rows):
            text = "".join(ALPHABET[int(t)] for t in ids[i].tolist())
            self.rows.append((text, [bool(m) for m in mask[i].tolist()], int(turns[i])))
        return await super().train_step(batch, algorithm)


def _segments(text: str, mask: list[bool]) -> list[tuple[bool, str]]:
    out: list[tuple[bool, str]] = []
    for ch, m in zip(text, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + ch)
        else:
            out.append((m, ch))
    return out


def _consistent(turns: list[str], marks: list[str]) -> bool:
    """Some secret in 0..9 makes the game answer ``turns`` with ``marks`` (a correct guess would have ended it)."""
    for secret in range(10):
        ok = True
        for turn, mark in zip(turns, marks, strict=False):
            well_formed = re.fullmatch(r"(0|[1-9][0-9]*)\.", turn)
            if not well_formed:
                want = "?"
            else:
                guess = int(turn[:-1])
                want = None if guess == secret else ("<" if secret < guess else ">")
            if want != mark:
                ok = False
                break
        if ok:
            return True
    return False


@pytest.mark.slow
def test_agent_example_runs_multi_turn_episodes_with_masked_feedback(tmp_path):
    resolved = resolve(load_config(EXAMPLE, [f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=0",
                                             "data.prompts_per_step=8", *PINNED]))
    resolved = resolved.with_factory("trainer", RecordingTrainer)
    RecordingTrainer.rows = []
    summary = run_flow(resolved, run_dir=tmp_path / "run", write_png=False)
    assert summary["steps"] == STEPS
    assert summary["max_staleness"] <= 1  # the train stage raises on a violation; this is the run's own record

    rows = RecordingTrainer.rows
    assert len(rows) == STEPS * 8 * 8
    assert max(t for _, _, t in rows) > 1, "no episode took more than one turn"
    masked = total = 0
    for text, mask, turns in rows:
        segs = _segments(text, mask)
        sampled = [s for m, s in segs if m]
        observed = [s for m, s in segs if not m]
        assert segs[0][0], f"{text!r}: an episode's response starts with the policy's turn"
        # every observed run is one feedback mark, after a sampled turn
        assert all(len(o) == 1 and o in "<>?" for o in observed), (text, mask)
        assert len(sampled) == turns and len(observed) == turns - 1, (text, mask, turns)
        assert _consistent(sampled, observed), f"the feedback in {text!r} is not the game's answer to its turns"
        masked += mask.count(False)
        total += len(mask)
    assert masked > 0

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "episode/masked_frac" in r]
    assert len(steps) == STEPS and all(r["episode/turns"] >= 1 for r in steps)
