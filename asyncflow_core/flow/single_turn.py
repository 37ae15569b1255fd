"""The single-turn episode: one prompt row, one generation request, the result is the row.

:class:`SingleTurn` is also the base of every episode kind: it holds what the
rollout stage's dispatch needs (row, lease, group, attempt, the resumed
prefix, the start version) and the request-level moves (resume after an
abort, retry a turn, restart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT
from asyncflow_core.types import GenerationRequest, GenerationResult, SamplingParams

__all__ = ["SingleTurn", "SingleTurnEpisodes", "as_tuple"]


def as_tuple(values: Sequence[Any] | torch.Tensor) -> tuple:
    """A result field (sequence or 1-D tensor) as a tuple of Python numbers, without a per-element loop.

    Zero-width (lengths-only) values become that many empty entries: only their count means anything.
    """
    if isinstance(values, torch.Tensor):
        if values.dim() > 1 and 0 in values.shape[1:]:
            return ((),) * values.shape[0]
        return tuple(values.tolist())
    return tuple(values)

@dataclass(eq=False)  # identity: a request is one object, whatever its fields
class SingleTurn:
    """One prompt row, one request: the result is the row. Also the base of every episode (the dispatch fields)."""

    multi_turn: ClassVar[bool] = False

    row: int
    lease: Any  #: the lease it came in (``meta``, ``remaining``): acked once all its rows are written
    prompt: tuple[int, ...]
    group: int
    attempt: int = 0
    prefix_ids: tuple[int, ...] = ()
    prefix_lps: tuple[float, ...] = ()
    prefix_versions: tuple[int, ...] = ()
    start_version: int = 0  #: oldest version its tokens can have (replica version at submission, or the prefix's)
    #: version of the weights its current attempt first started on (kept across resumes, reset when its tokens are
    #: thrown away); what its age counts from under ``async.staleness_basis: request_start``
    origin_version: int | None = None

    @property
    def request_id(self) -> str:
        return f"row{self.row}-try{self.attempt}"

    def request(self, sampling: SamplingParams) -> GenerationRequest:
        return GenerationRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt, sampling=sampling,
            prefix_token_ids=self.prefix_ids, prefix_logprobs=self.prefix_lps, prefix_versions=self.prefix_versions,
        )

    def held_versions(self) -> Sequence[int]:
        """Versions of the tokens the next request carries over (the resumed prefix)."""
        return self.prefix_versions

    def oldest_with(self, res: GenerationResult) -> int | None:
        """The oldest version of the row if ``res`` is taken into it (None: no tokens at all)."""
        return res.min_version

    def resume(self, res: GenerationResult) -> None:
        """Continue after the tokens of an aborted attempt (partial rollout), as a new request."""
        self.prefix_ids = as_tuple(res.token_ids)
        self.prefix_lps = as_tuple(res.logprobs)
        self.prefix_versions = as_tuple(res.versions)
        self.attempt += 1

    def retry_turn(self) -> None:
        """Start the current turn again without its partial tokens, as a new request."""
        self.prefix_ids, self.prefix_lps, self.prefix_versions = (), (), ()
        self.origin_version = None
        self.attempt += 1

    def restart(self) -> None:
        """Start again from the prompt, as a new request."""
        self.retry_turn()

class SingleTurnEpisodes:
    """The default episode factory: one completion per prompt row."""

    multi_turn = False
    columns: tuple[str, ...] = ROLLOUT_OUT

    def new(self, row: int, lease: Any, prompt: tuple[int, ...], group: int, ctx: Any) -> SingleTurn:
        return SingleTurn(row, lease, prompt, group)

    async def close(self) -> None:
        """Release what the factory holds (nothing here)."""

