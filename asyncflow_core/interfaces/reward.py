"""The Reward contract."""

from __future__ import annotations

import abc
from collections.abc import Awaitable

from asyncflow_core.types import RewardInput, RewardOutput


class Reward(abc.ABC):
    """Scores one sample. Sync or async; the runtime runs it in a pool.

    An exception raised here marks that sample as failed (recorded with the
    exception's message) and the run goes on; it never crashes the pipeline.
    A returned mapping must contain ``"reward"``; other keys are logged.
    """

    @abc.abstractmethod
    def score(self, sample: RewardInput) -> RewardOutput | Awaitable[RewardOutput]:
        """Return the reward of ``sample`` (a float, or a mapping with ``"reward"``)."""
