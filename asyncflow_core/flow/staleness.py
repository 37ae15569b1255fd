"""The staleness bound, as pure functions the runtime and its tests share.

Vocabulary. The trainer's version ``v`` counts optimizer steps taken; the
update that turns ``v`` into ``v + 1`` is "step v". A row's ``min_version``
is the oldest policy version among its generated tokens. With bound ``k``:

- **the rule** (:func:`is_fresh`): a row may be used in step v only if
  ``v - min_version <= k``;
- **admission** (:func:`admission_limit`): while the trainer is at version
  ``v`` the prompt feeder has started at most ``(k + v + 1) * B`` prompts
  (``B`` prompts per step, net of prompts dropped for good), so rollout never
  runs more than ``k + 1`` steps' worth of prompts ahead of training;
- **engines** (:func:`engine_may_start`): a rollout replica whose weights are
  older than ``v - k`` starts nothing new (it would only produce stale rows);
- **in flight** (:func:`must_abort`): when the trainer reaches ``v``, a
  request whose oldest token (or, before its first token, the version the
  replica had when it was submitted) is older than ``v - k`` can no longer
  be used and is aborted and re-queued.

:class:`StalenessGuard` applies the last two to live engines for the rollout stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def admission_limit(version: int, k: int, prompts_per_step: int) -> int:
    """Most prompts (net of dropped ones) that may have been started while the trainer is at ``version``."""
    if version < 0 or k < 0 or prompts_per_step < 1:
        raise ValueError(f"need version >= 0, k >= 0, prompts_per_step >= 1; got {version}, {k}, {prompts_per_step}")
    return (k + version + 1) * prompts_per_step


def is_fresh(step_version: int, min_version: torch.Tensor | int, k: int) -> torch.Tensor | bool:
    """True where a row of ``min_version`` may be used in the step that starts at ``step_version``."""
    return (step_version - min_version) <= k


def oldest_usable(step_version: int, k: int) -> int:
    """The oldest ``min_version`` step ``step_version`` (or any later step) can still use."""
    return step_version - k


def engine_may_start(engine_version: int, trainer_version: int, k: int) -> bool:
    """Whether a replica on ``engine_version`` weights may start a request now."""
    return engine_version >= trainer_version - k


def must_abort(oldest_token_version: int, trainer_version: int, k: int) -> bool:
    """Whether an in-flight request whose oldest token is ``oldest_token_version`` is already unusable."""
    return oldest_token_version < trainer_version - k


def split_fresh_groups(
    step_version: int, k: int, group_ids: torch.Tensor, min_version: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row masks (fresh, stale) where a group is stale as a whole if any of its rows is.

    Group-relative advantages need every sample of a prompt, so a group is
    used whole or not at all. Rows without a group (id < 0) stand alone.
    """
    stale_row = ~is_fresh(step_version, min_version, k)
    if not bool(stale_row.any()):
        return torch.ones_like(stale_row), stale_row
    grouped = group_ids >= 0
    stale_groups = torch.unique(group_ids[stale_row & grouped])
    stale = stale_row | (grouped & torch.isin(group_ids, stale_groups))
    return ~stale, stale


class StalenessGuard:
    """The bound applied to live engines: what a replica may start, and which generations are already unusable.

    ``run`` is anything with the trainer's current ``version`` and the bound
    ``k`` (the run's :class:`~asyncflow_core.flow.stage.FlowContext`); both
    are read at every call, so the guard follows the trainer.
    """

    def __init__(self, run: Any) -> None:
        self.run = run

    def may_start(self, engine_version: int) -> bool:
        """Whether a replica on ``engine_version`` weights may start a request now (:func:`engine_may_start`)."""
        return engine_may_start(engine_version, self.run.version, self.run.k)

    def unusable(self, oldest_token_version: int | None) -> bool:
        """Whether a generation whose oldest token is ``oldest_token_version`` can no longer be used
        (:func:`must_abort`); a generation without tokens (None) is never stale."""
        return oldest_token_version is not None and must_abort(oldest_token_version, self.run.version, self.run.k)

    @staticmethod
    def start_version(engine_version: int, prefix_versions: Sequence[int] = ()) -> int:
        """The oldest version a request's tokens can have when submitted to ``engine_version`` weights,
        resuming from tokens of ``prefix_versions``."""
        return min(engine_version, min(prefix_versions, default=engine_version))

    def to_abort(self, inflight: Mapping[str, Any], version: int | None = None) -> list[str]:
        """Request ids of ``inflight`` (id -> request with a ``start_version``) that are unusable at ``version``
        (default: the trainer's current one)."""
        v = self.run.version if version is None else version
        return [rid for rid, q in inflight.items() if must_abort(q.start_version, v, self.run.k)]
