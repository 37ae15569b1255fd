"""``reward.inline``: a local, synchronous reward scored in the rollout stage's write, with no reward stage.

Inline, the trajectory writer puts the reward columns in the same ``put`` as
the tokens, with the reward stage's own code (:meth:`Stage.outputs`), so
failures are isolated per row and counted exactly as before; rewards that are
remote, asynchronous or not declared local keep the reward stage.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.reward_inline import inline_reason, wants_inline
from asyncflow_core.flow.reward_stage import RewardStage
from asyncflow_core.flow.runtime import run_flow
from asyncflow_plugins.arithmetic import ArithmeticReward, ArithmeticRewardConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"


class _Local:
    local = True

    def score(self, sample):
        return 1.0


class _Undeclared:
    def score(self, sample):
        return 1.0


class _Async:
    local = True

    async def score(self, sample):
        return 1.0


class _Pool:
    local = True

    def score(self, sample):
        return 1.0

    async def score_many(self, samples, timeout_s):
        return [(True, 1.0) for _ in samples]


def _decide(setting, reward, *, single_turn=True, replaced=False):
    return wants_inline(setting, reward, name="r", single_turn=single_turn, replaced=replaced)


def test_auto_inlines_only_a_declared_local_synchronous_single_turn_reward():
    assert _decide(None, _Local()) is True
    assert _decide(None, ArithmeticReward(ArithmeticRewardConfig())) is True
    assert _decide(None, _Undeclared()) is False  # not declared: the reward stage, as before
    assert _decide(None, _Async()) is False  # reward.timeout_s and workers apply in the stage
    assert _decide(None, _Pool()) is False  # a remote pool's batches overlap rollout in the stage
    assert _decide(None, _Local(), single_turn=False) is False
    assert _decide(None, _Local(), replaced=True) is False
    assert _decide(False, _Local()) is False
    assert _decide(True, _Undeclared()) is True  # forced: any reward that can be scored inline


@pytest.mark.parametrize("reward, why", [(_Async(), "asynchronous"), (_Pool(), "score_many")])
def test_forcing_inline_on_a_reward_that_cannot_be_is_one_line_saying_why(reward, why):
    assert why in (inline_reason(reward) or "")
    with pytest.raises(ConfigError, match=f"reward.inline: true.*{why}.*null \\(auto\\) or false"):
        _decide(True, reward)
    with pytest.raises(ConfigError, match="multi-turn"):
        _decide(True, _Local(), single_turn=False)


class _FlakyLocal:
    """Raises for one prompt (its samples fail, its group is dropped); declared local, so auto inlines it."""

    needs_text = True
    local = True

    def score(self, sample):
        if sample.prompt == "1+1=":
            raise ValueError("reward said no")
        return 1.0


def _with_reward(resolved, factory):
    comp = resolved.components["reward"]
    record = dataclasses.replace(comp.registered.record, factory=factory)
    resolved.components["reward"] = dataclasses.replace(comp, registered=dataclasses.replace(comp.registered,
                                                                                              record=record))
    return resolved


@pytest.mark.parametrize("inline", ["null", "false"])
def test_inline_and_stage_score_and_fail_rows_alike(inline, tmp_path, monkeypatch):
    ran = []
    original = RewardStage.run

    async def run(self):
        ran.append(self.name)
        await original(self)

    monkeypatch.setattr(RewardStage, "run", run)
    cfg = resolve(load_config(EXAMPLE, ["trainer.total_steps=4", "pipeline.max_failure_rate=0.5",
                                        f"reward.inline={inline}"]))
    s = run_flow(_with_reward(cfg, lambda _: _FlakyLocal()), run_dir=tmp_path, write_png=False)
    assert ran == ([] if inline == "null" else ["reward"])  # inline: no reward stage task at all
    assert s["steps"] == 4 and s["stop_reason"] == "done"
    assert s["ledger"]["dropped"] >= 1 and s["ledger"]["dropped_failed"] == s["ledger"]["dropped"]
    assert s["counters"]["failed_reward"] >= 4  # the failed rows are the reward's, under its name
    led = s["ledger"]
    assert led["trained"] + led["dropped"] + led["unfinished"] == led["admitted"]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward_mean"] == 1.0 for r in records)  # every trained row has the reward it was scored


def test_the_spec_fails_a_reward_that_declares_local_but_scores_asynchronously():
    from asyncflow_spec.reward import RewardSpec

    class AsyncLocal:
        local = True

        async def score(self, sample):
            return 1.0

    with pytest.raises(AssertionError, match="local is on but score"):
        RewardSpec().test_a_local_reward_scores_synchronously(lambda: AsyncLocal())
