"""Generation requests and results exchanged with rollout engines."""

from __future__ import annotations

import enum
import functools
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

    # Computed once per result (the runtime asks several times per result) and cached in the instance
    # dict: results are immutable, ``versions`` included (consumers must not modify it in place).
    @functools.cached_property
    def min_version(self) -> int | None:
        """Oldest policy version among the tokens (``None`` when no token was generated)."""
        return _version_bound(self.versions, min)

    @functools.cached_property
    def max_version(self) -> int | None:
        """Newest policy version among the tokens (``None`` when no token was generated)."""
        return _version_bound(self.versions, max)


def with_version_range(result: GenerationResult, lo: int | None, hi: int | None) -> GenerationResult:
    """Record ``result``'s oldest and newest token versions when the engine already knows them (it then spares
    the scan of ``versions``); returns ``result``. They must be what :attr:`GenerationResult.min_version` and
    :attr:`GenerationResult.max_version` would compute."""
    result.__dict__["min_version"] = lo  # where functools.cached_property keeps them
    result.__dict__["max_version"] = hi
    return result


def _version_bound(versions: Sequence[int] | torch.Tensor, pick: Any) -> int | None:
    """``pick`` (min or max) of ``versions``; None when empty. One element answers for a constant view."""
    if not len(versions):
        return None
    if isinstance(versions, torch.Tensor):
        if versions.dim() == 1 and versions.stride(0) == 0:  # an expanded scalar (e.g. lengths-only results)
            return int(versions[0])
        return int(versions.min() if pick is min else versions.max())
    return int(pick(versions))
