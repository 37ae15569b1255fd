"""Conformance tests for Reward backends."""

from __future__ import annotations

import inspect
from typing import ClassVar

from asyncflow_core.interfaces import Reward
from asyncflow_core.interfaces.features import reward_features
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

    def test_batch_scoring_matches_one_at_a_time_or_is_not_declared(self, make_backend):
        """``supports_score_many`` on: ``score_many(samples, timeout_s)`` gives ``(True, value)`` per sample, equal
        to ``score``. Off: the reward must not expose a callable ``score_many`` (the reward stage then calls
        ``score`` per sample). Fix: declare ``features`` (RewardFeatures) to match what the reward does."""
        reward: Reward = make_backend()
        feats = reward_features(reward)
        if not feats.supports_score_many:
            try:
                many = getattr(reward, "score_many", None)
            except AttributeError:
                many = None
            assert not callable(many), "score_many is callable but RewardFeatures.supports_score_many is off"
            return
        answers = run(reward.score_many(list(self.samples), 60.0))  # type: ignore[attr-defined]
        assert [ok for ok, _ in answers] == [True] * len(self.samples), answers
        assert [v for _, v in answers] == [run(self._score(reward, s)) for s in self.samples]

    def test_a_local_reward_scores_synchronously(self, make_backend):
        """``local`` on: the rollout stage's write calls ``score`` inline (``reward.inline``), so it must return
        its value, not an awaitable. Off: nothing to check. Fix: make ``score`` synchronous, or leave ``local``
        off (the reward stage then scores it, with ``reward.workers`` and ``reward.timeout_s``)."""
        reward: Reward = make_backend()
        if not reward_features(reward).local:
            return
        for sample in self.samples:
            value = reward.score(sample)
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                raise AssertionError("RewardFeatures.local is on but score() returned an awaitable")

    def test_a_reward_that_reads_no_text_scores_token_ids(self, make_backend):
        """``needs_text`` off: the reward stage passes empty text; the reward must score from the token ids
        (and metadata) alone. On: nothing to check here (text is always given)."""
        reward: Reward = make_backend()
        if reward_features(reward).needs_text:
            return
        for sample in self.samples:
            blank = RewardInput(prompt=sample.prompt, completion="", prompt_token_ids=(1, 2),
                                completion_token_ids=(3, 4), metadata=sample.metadata)
            value = run(self._score(reward, blank))
            scalar = value["reward"] if isinstance(value, dict) else value
            assert isinstance(scalar, float) and scalar == scalar, f"bad reward {value!r} without text"

    def test_every_extra_value_it_returns_is_declared(self, make_backend):
        """A mapping's keys other than ``"reward"`` are store columns only when declared: the reward stage keeps
        ``RewardFeatures.extras`` (``reward_extra/<key>``) and drops the rest with a warning. Fix: name each
        extra key in ``RewardFeatures.extras`` (or the class attribute ``extras``), or stop returning it."""
        reward: Reward = make_backend()
        declared = set(reward_features(reward).extras)
        for sample in self.samples:
            value = run(self._score(reward, sample))
            if isinstance(value, dict):
                undeclared = sorted(set(value) - {"reward"} - declared)
                assert not undeclared, f"returns undeclared extra values {undeclared}; declared: {sorted(declared)}"
