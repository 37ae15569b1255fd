"""Generation requests and results exchanged with rollout engines."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import torch

from asyncflow_core.errors import BatchError


class FinishReason(str, enum.Enum):
    """Why a completion ended."""

    STOP = "stop"  #: an end-of-sequence / stop token was sampled (it is included in ``token_ids``)
    LENGTH = "length"  #: ``max_new_tokens`` was reached
    ABORT = "abort"  #: aborted (partial rollout): the tokens generated so far are returned
    ERROR = "error"  #: the engine failed on this request; ``error`` says why


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Engines must honour every field or refuse the request.

    Log-prob convention (the same in every engine and in the trainer): the
    log-prob of a sampled token is taken from the distribution it was *sampled
    from*, i.e. after temperature scaling and top-p/top-k truncation, renormalised.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  #: -1 disables top-k
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  #: per-request seed; ``None`` draws from the engine's generator

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise BatchError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise BatchError(f"temperature must be > 0, got {self.temperature} (use a small value for near-greedy)")
        if not 0 < self.top_p <= 1:
            raise BatchError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise BatchError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete.

    ``request_id`` is unique among the requests in flight on an engine.
    ``prefix_token_ids`` / ``prefix_logprobs`` / ``prefix_versions`` carry the
    tokens of an earlier, aborted attempt (partial rollout): an engine that can
    resume continues after them (and returns them as part of the result), one
    that cannot must start over and say so through its ``Features``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefix_token_ids: tuple[int, ...] = ()
    prefix_logprobs: tuple[float, ...] = ()
    prefix_versions: tuple[int, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise BatchError(f"request {self.request_id!r} has an empty prompt")
        n = len(self.prefix_token_ids)
        if len(self.prefix_logprobs) != n or len(self.prefix_versions) != n:
            raise BatchError(
                f"request {self.request_id!r}: prefix_token_ids, prefix_logprobs and prefix_versions must have the "
                f"same length, got {n}, {len(self.prefix_logprobs)}, {len(self.prefix_versions)}"
            )


@dataclass(frozen=True)
class GenerationResult:
    """A finished (or aborted) completion.

    ``token_ids``, ``logprobs`` and ``versions`` are aligned, one entry per
    generated token (the prompt excluded, a resumed prefix included). Each is
    a sequence of numbers or a 1-D tensor (engines that already hold tensors
    return them as they are; the runtime packs either without a Python loop):
    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the sampling
    distribution (see :class:`SamplingParams`), ``versions[i]`` the policy
    version of the weights that sampled it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: Sequence[int] | torch.Tensor
    logprobs: Sequence[float] | torch.Tensor
    versions: Sequence[int] | torch.Tensor
    finish_reason: FinishReason
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise BatchError(
                f"result {self.request_id!r}: token_ids, logprobs and versions must be aligned, "
                f"got lengths {n}, {len(self.logprobs)}, {len(self.versions)}"
            )

    @property
    def min_version(self) -> int | None:
        """Oldest policy version among the tokens (``None`` when no token was generated)."""
        if not len(self.versions):
            return None
        return int(self.versions.min()) if isinstance(self.versions, torch.Tensor) else min(self.versions)

    @property
    def max_version(self) -> int | None:
        if not len(self.versions):
            return None
        return int(self.versions.max()) if isinstance(self.versions, torch.Tensor) else max(self.versions)
