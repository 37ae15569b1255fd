"""A finished episode as tokens: what a multi-turn rollout (or a captured agent session) hands the writer.

Token-in/token-out: ``prompt_ids`` are the tokens the first turn was sampled
after; ``segments`` follow in order, each either *sampled* (the engine's
tokens exactly as returned, with their behaviour log-probs and the policy
version of each token: loss mask 1) or *observed* (an observation, tool
output or template glue rendered once by the runtime: loss mask 0, log-prob
0, and no version of their own). The trained sequence is
``prompt_ids + concat(segment.token_ids)``, the same tokens the engine saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Segment:
    token_ids: tuple[int, ...]
    sampled: bool  #: True: the policy sampled these tokens (loss mask 1); False: observation/tool/glue (mask 0)
    logprobs: tuple[float, ...] = ()  #: sampled only: behaviour log-probs, one per token
    versions: tuple[int, ...] = ()  #: sampled only: policy version of each token
    turn: int = 0  #: the turn this segment belongs to (an observation belongs to the turn it answers)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.sampled and (len(self.logprobs) != n or len(self.versions) != n):
            raise ValueError(f"a sampled segment needs one log-prob and one version per token ({n} tokens, "
                             f"{len(self.logprobs)} log-probs, {len(self.versions)} versions)")
        if not self.sampled and (self.logprobs or self.versions):
            raise ValueError("an observed segment carries no log-probs or versions")


@dataclass
class Trajectory:
    """One episode. ``status`` is ``ok`` or the recorded reason it failed (``failed: <why>``)."""

    prompt_ids: tuple[int, ...]
    segments: list[Segment] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)  #: one per policy turn
    reward: float | None = None  #: the episode's reward when the environment owns it; None: a reward plugin scores
    status: str = "ok"
    info: dict[str, Any] = field(default_factory=dict)  #: per-episode metrics: tool calls, tool_ok, env seconds, ...

    @property
    def response_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)

    @property
    def loss_mask(self) -> tuple[int, ...]:
        return tuple(int(s.sampled) for s in self.segments for _ in s.token_ids)

    @property
    def turns(self) -> int:
        return sum(1 for s in self.segments if s.sampled)

    def sampled_versions(self) -> Sequence[int]:
        return [v for s in self.segments if s.sampled for v in s.versions]
