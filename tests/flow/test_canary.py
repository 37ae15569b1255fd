"""The weights canary catches a rollout engine that does not run the trainer's weights, and leaves a correct one be.

The "frozen" engine below is the real toy engine with one defect: its
``update_weights`` checks every bucket and bumps its version, but never
installs the new table, so it samples from version 0 forever while claiming
each new version. Nothing else in a run notices (the run ends "done").
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import WeightTransferError
from asyncflow_core.flow.runtime import run_flow
from asyncflow_core.flow.stage import RunStopped
from asyncflow_plugins.toy.rollout import ToyRolloutEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"
STEPS = 12
EVERY = 2
#: a correct engine scores its tokens with the trainer's float32 function: they agree to float32 rounding of a
#: log-softmax over 16 logits (~1e-7 relative to log-probs of a few units); 1e-5 leaves a 100x margin
AGREE = 1e-5
#: the frozen engine lags the trainer by EVERY Adam steps of lr 0.05 at the first check (Adam moves a trained logit
#: by about lr per step): its log-probs of the step's prompts are off by a few 1e-2 (0.04 to 0.17 measured);
#: 0.005 sits well below that and more than two orders of magnitude above AGREE
LIMIT = 0.005


class FrozenToy(ToyRolloutEngine):
    """Verifies each update and bumps the version, but keeps sampling from its version-0 table."""

    async def update_weights(self, version, buckets, *, kv_cache=None):
        async for bucket in buckets:
            bucket.verify()
            if bucket.version != version:
                raise WeightTransferError("wrong version")
        self._version = version  # the defect: self._table is never replaced


def toy(*overrides: str, engine=None):
    resolved = resolve(load_config(EXAMPLE, [f"trainer.total_steps={STEPS}", "data.epochs=100", "canary.samples=8",
                                             *overrides]))
    if engine is not None:
        comp = resolved.components["rollout"]
        record = dataclasses.replace(comp.registered.record, factory=engine)
        resolved.components["rollout"] = dataclasses.replace(
            comp, registered=dataclasses.replace(comp.registered, record=record))
    return resolved


def canary_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "canary/mean_abs_dlogp" in r]


def test_an_engine_that_never_applies_weights_stops_the_run_with_the_engine_named(tmp_path):
    resolved = toy(f"canary.every={EVERY}", f"canary.warn_above={LIMIT}", f"canary.stop_above={LIMIT}",
                   engine=FrozenToy)
    with pytest.raises(RunStopped) as info:
        run_flow(resolved, run_dir=tmp_path, write_png=False)
    message = str(info.value)
    assert "\n" not in message
    assert "rollout engine 'toy' (replica 0) does not appear to be running the trainer's weights" in message
    assert f"at version {EVERY}" in message and "mean |Δlogp| = " in message
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == EVERY  # stopped before training on from the first check, far from "done"
    assert "does not appear to be running the trainer's weights" in summary["stop_reason"]


def test_warn_only_flags_every_check_with_the_metric_and_a_warning(tmp_path, caplog):
    resolved = toy(f"canary.every={EVERY}", f"canary.warn_above={LIMIT}", "canary.stop_above=null",
                   engine=FrozenToy)
    with caplog.at_level(logging.WARNING, logger="asyncflow.flow"):
        summary = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert summary["stop_reason"] == "done"  # it was told only to warn
    checks = canary_records(tmp_path)
    # a check of version v (every EVERY steps, from EVERY on) is logged with step v + 1, the step that trains v
    assert [r["step"] for r in checks] == list(range(EVERY + 1, STEPS + 1, EVERY))
    assert all(r["canary/mean_abs_dlogp"] > LIMIT and r["canary/tokens"] > 0 for r in checks)
    warnings = [r.getMessage() for r in caplog.records if "does not appear to be running" in r.getMessage()]
    assert len(warnings) == len(checks)
    assert summary["counters"]["canary_warnings"] == len(checks)


def test_a_correct_engine_is_checked_and_not_flagged(tmp_path, caplog):
    resolved = toy(f"canary.every={EVERY}", f"canary.warn_above={LIMIT}", f"canary.stop_above={LIMIT}")
    with caplog.at_level(logging.WARNING, logger="asyncflow.flow"):
        summary = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert summary["stop_reason"] == "done" and summary["steps"] == STEPS
    checks = canary_records(tmp_path)
    assert [r["step"] for r in checks] == list(range(EVERY + 1, STEPS + 1, EVERY))
    assert all(r["canary/tokens"] > 0 and r["canary/max_abs_dlogp"] <= AGREE for r in checks), checks
    assert not [r for r in caplog.records if "does not appear to be running" in r.getMessage()]
    assert "canary_warnings" not in summary["counters"]


def test_the_canary_is_off_without_a_model_unless_asked(tmp_path):
    run_flow(toy(), run_dir=tmp_path, write_png=False)
    assert canary_records(tmp_path) == []
