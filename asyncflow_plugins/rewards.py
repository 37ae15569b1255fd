"""Built-in rewards: ``exact_match`` (the completion's answer equals ``metadata['answer']``)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces import Reward
from asyncflow_core.plugins import RewardBackend, hookimpl
from asyncflow_core.types import RewardInput


class ExactMatchConfig(BaseModel):
    """Options of ``exact_match``."""

    model_config = ConfigDict(extra="forbid")

    answer_key: str = Field("answer", description="Metadata key holding the reference answer.")
    extract_boxed: bool = Field(True, description="Compare the last \\boxed{...} content when the completion has one.")
    strip: bool = Field(True, description="Ignore surrounding whitespace.")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


class ExactMatch(Reward):
    """1.0 when the (extracted) answer equals the reference exactly, else 0.0.

    A sample without the reference answer in its metadata raises
    ``KeyError`` — the runtime records that sample as failed.
    """

    def __init__(self, config: ExactMatchConfig) -> None:
        self.config = config

    def score(self, sample: RewardInput) -> float:
        reference = str(sample.metadata[self.config.answer_key])
        answer = sample.completion
        if self.config.extract_boxed:
            boxed = last_boxed(answer)
            answer = boxed if boxed is not None else answer
        if self.config.strip:
            answer, reference = answer.strip(), reference.strip()
            answer = re.sub(r"\s+", " ", answer)
        return float(answer == reference)


@hookimpl
def asyncflow_rewards():
    yield RewardBackend(
        name="exact_match",
        factory=ExactMatch,
        config_model=ExactMatchConfig,
        description="1 if the completion (or its last \\boxed{}) equals metadata['answer'], else 0.",
    )
