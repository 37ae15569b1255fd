"""A reward's extra values (``correct`` beside a shaped ``reward``) are declared store columns.

Each key of ``RewardFeatures.extras`` becomes a dense float32 column
``reward_extra/<key>`` the reward stage writes for every row (NaN where the
sample lacked it); the trainer's batch carries them and each step's record
averages them. They once lived in a dict on the stage, outside the store.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.reward_stage import RewardStage, reward_extras
from asyncflow_core.flow.tokenizer import CharTokenizer
from asyncflow_core.interfaces import Reward
from asyncflow_core.interfaces.features import RewardFeatures, reward_features
from asyncflow_core.types import Batch
from asyncflow_spec.base import run
from asyncflow_spec.stage import StageSpec


class ByLength(Reward):
    needs_text = True
    extras = ("correct", "long")

    def __init__(self) -> None:
        self.calls = 0

    def score(self, sample):
        self.calls += 1
        n = len(sample.completion_token_ids)
        if n == 3:
            raise ValueError("three tokens are refused")
        out = {"reward": n / 4, "correct": float(n % 2 == 0), "note": 1.0}
        if n == 4:
            out["long"] = 1.0
        return out


def test_declared_extras_are_columns_with_nan_where_missing_and_undeclared_keys_are_reported_once(caplog):
    spec = StageSpec()
    batch = spec.make_batch(spec.rows)
    stage = RewardStage(ByLength(), CharTokenizer("abcdefghijklmnop"), workers=1, timeout_s=5.0)
    assert stage.produces == (C.REWARD, "reward_extra/correct", "reward_extra/long")
    with caplog.at_level(logging.WARNING, logger="asyncflow_core.flow.reward_stage"):
        ctx, written = run(spec.through_the_loop(stage, batch))
    lengths = batch[C.RESPONSE_IDS].lengths.tolist()
    correct = written["reward_extra/correct"]
    long_ = written["reward_extra/long"]
    assert correct.dtype == long_.dtype == torch.float32 and correct.shape == (batch.num_rows,)
    for i, n in enumerate(lengths):
        if n == 3:  # failed: its row is settled, the columns hold placeholders and the trainer never sees it
            continue
        assert written[C.REWARD][i] == n / 4
        assert correct[i] == float(n % 2 == 0)
        assert (long_[i] == 1.0) if n == 4 else math.isnan(long_[i])
    assert ctx.counters["failed_reward"] == lengths.count(3) > 0
    # the undeclared key: one warning naming it and the fix, counted per sample, never a column
    warned = [r.getMessage() for r in caplog.records if "'note'" in r.getMessage()]
    assert len(warned) == 1 and "extras" in warned[0], warned
    assert stage.undeclared["note"] == len(lengths) - lengths.count(3)
    assert not any("note" in c for c in written.columns)


def test_each_steps_record_averages_the_rows_that_have_a_value():
    batch = Batch({
        C.REWARD: torch.zeros(4),
        "reward_extra/correct": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "reward_extra/long": torch.tensor([float("nan"), 1.0, float("nan"), 0.0]),
        "reward_extra/never": torch.full((4,), float("nan")),
    })
    assert reward_extras(batch) == {"correct": 0.75, "long": 0.5}


def test_a_reward_without_extras_produces_the_reward_alone_and_bad_declarations_are_one_line():
    class Plain(Reward):
        def score(self, sample):
            return 1.0

    stage = RewardStage(Plain(), CharTokenizer("ab"), workers=1, timeout_s=1.0)
    assert stage.produces == (C.REWARD,)
    assert RewardFeatures(extras=("a", "b")).extras == ("a", "b")
    for bad in (("reward",), ("a/b",), ("a", "a"), ("",)):
        Plain.extras = bad
        with pytest.raises(ValueError) as err:
            reward_features(Plain())
        assert "\n" not in str(err.value) and "Plain.extras" in str(err.value), err.value


def test_a_ray_reward_pool_declares_the_extras_of_the_reward_its_actors_host():
    """Under the ray launcher the reward stage talks to a pool of reward actors: the pool's features carry the
    hosted reward's declared extras (from the actor's description), so the columns exist under ray too."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from asyncflow_core.launchers.ray.actors import RewardActor
    from asyncflow_core.launchers.ray.remote import RemoteRewardPool
    from asyncflow_plugins.arithmetic import ArithmeticReward, ArithmeticRewardConfig

    desc = RewardActor(ArithmeticReward, ArithmeticRewardConfig()).describe()
    assert desc["extras"] == ["correct", "formatted"] and desc["needs_text"] is True
    pool = RemoteRewardPool.__new__(RemoteRewardPool)  # the description as the first actor would answer it
    pool._desc = SimpleNamespace(get=lambda: desc)
    assert reward_features(pool).extras == ("correct", "formatted")
    stage = RewardStage(pool, CharTokenizer("0123456789+-=."), workers=1, timeout_s=5.0)
    assert stage.produces == (C.REWARD, "reward_extra/correct", "reward_extra/formatted")
