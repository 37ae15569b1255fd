"""Bad input in a real run: environment exceptions, time-outs, malformed tool calls and oversize episodes.

A short run on the toy engines (bigram rollout and trainer, GRPO, one_step)
with the ``faulty`` environment (tests/flow/faulty_env.py), whose fault is
picked per dataset row: some rows' episodes raise, time out, emit malformed
tool calls or grow past ``max_episode_tokens``, the others are fine. What the
run records is then checked against what the environment was told to do:

- every admitted prompt is trained once, dropped with a reason, or unfinished
  at the stop (the ledger), and no prompt group reaches the trainer twice;
- every failed row has its one-line reason, and it is the fault's reason;
  exactly the prompts whose environment fails are dropped, and never trained;
- malformed tool calls are answered, not failures: those episodes train, with
  their failed calls counted (``episode_tool_ok``) and the reason in the run's
  counters (``tool_error: <reason>``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path

from asyncflow_core import columns as C
from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.flow.runtime import FlowRuntime
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_plugins.toy.train import ToyTrainEngine
from tests.flow import faulty_env as F

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [json.loads(line)["prompt"] for line in (ROOT / "examples/data/toy_prompts.jsonl").read_text().splitlines()]
#: the fault of dataset index i (8 prompts): 5 train (ok or malformed), 3 fail
FAULTS = ["ok", "raise", "ok", "timeout", "malformed", "oversize", "ok", "malformed"]
STEPS, B, N = 3, 4, 4
#: long enough that no fine step (microseconds) ever meets it on a loaded machine; the timeouts overlap the run
STEP_TIMEOUT_S = 1.0
ALPHABET = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz.,?"  # the default model.alphabet (the toy uses 0..15)


class RecordingToyTrainer(ToyTrainEngine):
    """The toy trainer, keeping every trained row's prompt, group, loss mask and tool-call counts."""

    rows: list[dict] = []

    async def train_step(self, batch, algorithm):
        for i in range(batch.num_rows):
            type(self).rows.append({
                "prompt": "".join(ALPHABET[t] for t in batch[C.PROMPT_IDS][i].tolist()),
                "group": int(batch[C.GROUP_ID][i]),
                "mask": batch[C.LOSS_MASK][i].tolist(),
                "tool_calls": int(batch[C.EPISODE_TOOL_CALLS][i]),
                "tool_ok": int(batch[C.EPISODE_TOOL_OK][i]),
            })
        return await super().train_step(batch, algorithm)


def _config():
    data = {
        "name": "faults", "seed": 0,
        "data": {"name": "jsonl", "options": {"path": str(ROOT / "examples/data/toy_prompts.jsonl")},
                 "prompts_per_step": B, "epochs": 20},
        "rollout": {"name": "toy", "options": {"vocab_size": 16, "seed": 0}, "n": N, "max_new_tokens": 2},
        "trainer": {"name": "toy", "options": {"vocab_size": 16, "seed": 0, "lr": 0.05}, "total_steps": STEPS},
        "algorithm": {"name": "grpo", "options": {"group_size": N}},
        "reward": {"name": "exact_match"},
        # prompt 4 + three turns of 2 + two observations of 1 = 12 tokens; the oversize observation breaks 20
        "environment": {"name": "faulty", "max_turns": 4, "step_timeout_s": STEP_TIMEOUT_S, "max_episode_tokens": 20,
                        "options": {"faults": FAULTS, "turns": 3, "oversize_chars": 32}},
        "pipeline": {"max_failure_rate": 1.0},  # most rows fail on purpose
        "async": {"mode": "one_step"},
    }
    resolved = resolve(load_config(data=data))
    resolved = resolved.with_factory("trainer", RecordingToyTrainer)
    return resolved


def test_a_run_with_a_faulty_environment_records_every_fault_and_loses_or_repeats_nothing(tmp_path, fresh_plugins):
    get_plugin_manager().register_module(F, distribution="tests", name="tests.flow.faulty_env")
    RecordingToyTrainer.rows = []
    runtime = FlowRuntime(_config(), run_dir=tmp_path, write_png=False)
    summary = asyncio.run(asyncio.wait_for(runtime.run(), 120))
    ctx = runtime.ctx
    assert summary["steps"] == STEPS and summary["stop_reason"] == "done"

    def kind(uid: int) -> str:
        return F.fault_of(uid % len(PROMPTS), FAULTS)  # prompt uid = epoch * len(dataset) + index

    # the ledger: every admission accounted for, once
    led = summary["ledger"]
    assert led["admitted"] == led["trained"] + led["dropped"] + led["unfinished"]
    # ... and each admitted prompt is in exactly one place: trained, dropped, or live (in flight or re-queued)
    live = [g.prompt_uid for g in ctx.ledger.groups.values()] + [g.prompt_uid for g in ctx.ledger.requeue]
    places = [*ctx.ledger.trained, *ctx.ledger.dropped, *live]
    assert len(set(places)) == len(places) == led["admitted"], "a prompt was lost or is in two places"
    assert led["trained"] == STEPS * B and not (ctx.ledger.trained & set(ctx.ledger.dropped))
    assert {kind(u) for u in ctx.ledger.trained} <= {"ok", "malformed"}
    assert {kind(u) for u in ctx.ledger.dropped} <= set(F.FAILING), ctx.ledger.dropped
    assert set(ctx.ledger.dropped.values()) == {"failed"} and led.get("dropped_failed") == len(ctx.ledger.dropped)
    assert {kind(u) for u in ctx.ledger.dropped} == set(F.FAILING), "every kind of failure should have happened"

    # the trainer saw each of those groups once, whole, and no failing prompt
    rows = RecordingToyTrainer.rows
    assert len(rows) == STEPS * B * N == summary["samples_trained"]
    per_group = Counter(r["group"] for r in rows)
    assert set(per_group.values()) == {N} and len(per_group) == STEPS * B  # no group trained twice or in part
    trained_kinds = Counter(F.fault_of(PROMPTS.index(r["prompt"]), FAULTS) for r in rows)
    assert set(trained_kinds) <= {"ok", "malformed"} and trained_kinds["malformed"] > 0, trained_kinds
    for r in rows:
        assert r["mask"].count(True) == 6 and r["mask"].count(False) == 2  # three turns, two observations
        if F.fault_of(PROMPTS.index(r["prompt"]), FAULTS) == "malformed":
            assert (r["tool_calls"], r["tool_ok"]) == (3, 0)
        else:
            assert (r["tool_calls"], r["tool_ok"]) == (3, 3)

    # every failed row has its reason, the fault's; the counters agree with the reasons
    reasons = {row: str(why) for row, why in ctx.outcomes.reasons.items()}
    assert reasons and all(why.startswith("rollout: ") for why in reasons.values())
    seen = Counter()
    for why in reasons.values():
        found = {k: m for k, pattern in F.FAILING.items() if (m := re.match(f"rollout: {pattern}", why))}
        assert len(found) == 1, f"a failed row's reason is not one fault's: {why!r}"
        (k, m), = found.items()
        seen[k] += 1
        if k == "raise":
            assert F.fault_of(int(m["index"]), FAULTS) == "raise"
        if k == "timeout":
            assert float(m["seconds"]) == STEP_TIMEOUT_S
        if k == "oversize":  # prompt 4 + turn 2 + the 32-character observation
            assert (int(m["tokens"]), int(m["limit"])) == (4 + 2 + 32, 20)
    assert set(seen) == set(F.FAILING)
    counters = summary["counters"]
    assert counters["failed_rollout"] == len(reasons) == counters.get("episodes_failed", len(reasons))
    # a dropped group's rows all failed, each with its reason (the fault is the prompt's: every sample hits it);
    # rows of a failing group still live at the stop may have failed too
    live_failing = sum(1 for u in live if kind(u) in F.FAILING)
    assert N * len(ctx.ledger.dropped) <= len(reasons) <= N * (len(ctx.ledger.dropped) + live_failing)

    # malformed tool calls: answered, counted, and their reason recorded in the run's counters
    assert counters.get("episode_tool_errors", 0) >= 3 * trained_kinds["malformed"], counters
    assert counters.get(f"tool_error: {F.MALFORMED_REASON}", 0) == counters["episode_tool_errors"], counters
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and any(r["episode/tool_ok_rate"] < 1.0 for r in records)
