"""Conformance tests for Reward backends."""

from __future__ import annotations

import inspect
from typing import ClassVar

from asyncflow_core.interfaces import Reward
from asyncflow_core.plugins import PluginKind
from asyncflow_core.types import RewardInput
from asyncflow_spec.base import BackendSpec, run


class RewardSpec(BackendSpec):
    """Subclass and set ``backend``/``options`` and ``samples``: inputs the reward must score without raising."""

    kind = PluginKind.REWARD
    samples: ClassVar[tuple[RewardInput, ...]] = (
        RewardInput(prompt="1+1=", completion="2", metadata={"answer": "2"}),
        RewardInput(prompt="1+1=", completion="3", metadata={"answer": "2"}),
    )

    async def _score(self, reward: Reward, sample: RewardInput):
        value = reward.score(sample)
        return await value if inspect.isawaitable(value) else value

    def test_scores_are_finite_floats_or_mappings_with_reward(self, make_backend):
        """``score`` returns a float, or a mapping of floats containing ``"reward"``; sync or async."""
        reward: Reward = make_backend()
        for sample in self.samples:
            value = run(self._score(reward, sample))
            scalar = value["reward"] if isinstance(value, dict) else value
            assert isinstance(scalar, float) and scalar == scalar, f"bad reward {value!r} for {sample}"

    def test_deterministic(self, make_backend):
        """Scoring the same sample twice gives the same value (rewards must be replayable)."""
        reward: Reward = make_backend()
        for sample in self.samples:
            assert run(self._score(reward, sample)) == run(self._score(reward, sample))
