"""The tool-use example (examples/agent_calculator.yaml) for two steps on real engines: torch rollout, fsdp trainer.

What the trainer receives is checked against the calculator itself: every
token with loss mask 0 is the tool's answer to the sampled turn right before
it (``<value>=`` for a call of one operation, ``?=`` for anything else the
calculator refuses); a turn that is an integer ends the episode; each row's
reward is the environment's (0.1 per evaluated call, at most 3, plus 1 for
the right final answer, recomputed here from the prompt); no staleness
violation. The single-turn baseline file is loaded and validated too.
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
from asyncflow_plugins.envs.calculator import CalcError, evaluate  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ALPHABET = "0123456789+-*=.?"
STEPS = 2
PROMPTS = 4
PINNED = ("rollout.options.device=cpu", "trainer.options.device=cpu", "trainer.options.mixed_precision=float32")


class RecordingTrainer(FSDPTrainEngine):
    """The fsdp engine, keeping each trained row's prompt, response, loss mask, turns and reward."""

    rows: list[tuple[str, str, list[bool], int, float]] = []

    async def train_step(self, batch, algorithm):
        prompts, ids, mask = batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], batch[C.LOSS_MASK]
        turns, rewards = batch[C.EPISODE_TURNS].tolist(), batch[C.REWARD].tolist()
        for i in range(batch.num_rows):
            self.rows.append(("".join(ALPHABET[int(t)] for t in prompts[i].tolist()),
                              "".join(ALPHABET[int(t)] for t in ids[i].tolist()),
                              [bool(m) for m in mask[i].tolist()], int(turns[i]), float(rewards[i])))
        return await super().train_step(batch, algorithm)


def _segments(text: str, mask: list[bool]) -> list[tuple[bool, str]]:
    out: list[tuple[bool, str]] = []
    for ch, m in zip(text, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + ch)
        else:
            out.append((m, ch))
    return out


def _answer(turn: str) -> str | None:
    """The integer a turn answers with, or None when the turn is a call (the environment's parse)."""
    body = turn[:-1] if turn.endswith(".") else turn
    return body.strip() if re.fullmatch(r"-?\d+", body.strip()) else None


def _tool_reply(turn: str) -> tuple[str, bool]:
    """What the calculator answers to a call, and whether it evaluated it (one operation at most)."""
    body = turn[:-1] if turn.endswith(".") else turn
    try:
        return f"{evaluate(body, max_ops=1)[0]}=", True
    except CalcError:
        return "?=", False


@pytest.mark.slow
def test_calculator_example_trains_on_tool_episodes_with_the_tool_results_masked(tmp_path):
    load_config(EXAMPLES / "agent_calculator_single.yaml")  # the baseline is a valid config too
    resolved = resolve(load_config(EXAMPLES / "agent_calculator.yaml", [
        f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=0", f"data.prompts_per_step={PROMPTS}", *PINNED]))
    resolved = resolved.with_factory("trainer", RecordingTrainer)
    RecordingTrainer.rows = []
    summary = run_flow(resolved, run_dir=tmp_path / "run", write_png=False)
    assert summary["steps"] == STEPS
    assert summary["max_staleness"] <= 1  # the train stage raises on a violation; this is the run's own record

    rows = RecordingTrainer.rows
    assert len(rows) == STEPS * PROMPTS * 8
    assert max(t for *_, t, _ in rows) > 1, "no episode took more than one turn"
    calls = evaluated = 0
    for prompt, text, mask, turns, reward in rows:
        assert re.fullmatch(r"\d\d\*\d\d\+\d\d\*\d\d=", prompt), prompt
        segs = _segments(text, mask)
        sampled = [s for m, s in segs if m]
        observed = [s for m, s in segs if not m]
        assert segs[0][0], f"{text!r}: an episode's response starts with the policy's turn"
        # every turn but the last is answered by the tool; the last one ended the episode (or max_turns did)
        assert len(sampled) == turns and len(observed) == turns - 1, (text, mask, turns)
        ok_calls = 0
        for turn, reply in zip(sampled, observed, strict=False):
            assert _answer(turn) is None, f"{text!r}: the episode went on after the answer {turn!r}"
            want, ok = _tool_reply(turn)
            assert reply == want, f"{text!r}: the calculator answers {turn!r} with {want!r}, the row has {reply!r}"
            ok_calls += ok
            calls += 1
        answer = _answer(sampled[-1])
        if answer is None:  # cut at max_turns while still calling: the last call's reply is not in the row
            assert turns == 6, (text, turns)
            _, ok = _tool_reply(sampled[-1])
            ok_calls += ok
        correct = answer is not None and int(answer) == evaluate(prompt[:-1])[0]
        assert reward == pytest.approx(0.1 * min(ok_calls, 3) + correct, abs=1e-6), (text, reward, ok_calls)
        evaluated += ok_calls
    # a random policy's turn is a well-formed one-operation call about 4 % of the time: ~13 in 64 episodes
    assert calls > 0 and evaluated > 0, (calls, evaluated)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "episode/masked_frac" in r]
    assert len(steps) == STEPS and all(r["episode/turns"] >= 1 and 0 <= r["episode/tool_ok_rate"] <= 1 for r in steps)
