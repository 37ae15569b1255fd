"""Dataset records and reward inputs/outputs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRecord:
    """One prompt from a dataset.

    ``index`` is the record's stable position in its dataset (the data cursor
    a resumed run continues from). ``prompt_token_ids`` may be empty when the
    dataset yields text only and tokenization happens downstream.
    ``metadata`` carries whatever a reward needs (e.g. the reference answer).
    """

    index: int
    prompt: str
    prompt_token_ids: tuple[int, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees of one sample."""

    prompt: str
    completion: str
    prompt_token_ids: tuple[int, ...] = ()
    completion_token_ids: tuple[int, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)


RewardOutput = float | Mapping[str, float]
"""A scalar reward, or named components of which ``"reward"`` is the scalar used for training."""
