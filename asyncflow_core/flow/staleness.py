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
  and, when declared (``async.start_on_step_weights``), a prompt admitted for
  step ``s`` waits for weights of ``s - k`` or newer (:func:`start_floor`),
  which a replica still loading the newest version does not have yet;
- **in flight** (:func:`must_abort`): when the trainer reaches ``v``, a
  request whose oldest token (or, before its first token, the version the
  replica had when it was submitted) is older than ``v - k`` can no longer
  be used and is aborted and re-queued.

:class:`TailPolicy` holds the declared options for long tails (``async.overprovision``,
``async.staleness_basis``, ``async.stale_tail``; docs/simulation.md, "Tail policies"):
extra prompts admitted beyond the formula above, which version a row's age counts
from, and what a request that fell out of the bound does. Whatever they say, the
rule above is checked on every trained row against the row's declared version.

:class:`StalenessGuard` applies the last two to live engines for the rollout stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: a row's age counts from its oldest sampled token's version (the exact bound, the default)
OLDEST_TOKEN = "oldest_token"
#: a row's age counts from the version of the weights its request started on (kept across resumes)
REQUEST_START = "request_start"
#: a request that fell out of the bound starts again from the prompt (its group waits for it)
RESTART = "restart"
#: a request that fell out of the bound is written at once as it is (stale), so its group settles now
SETTLE_GROUP = "settle_group"


def admission_limit(version: int, k: int, prompts_per_step: int, extra: int = 0) -> int:
    """Most prompts (net of dropped ones) that may have been started while the trainer is at ``version``;
    ``extra``: prompts admitted beyond the bound's ``k + 1`` steps (over-provisioned admission)."""
    if version < 0 or k < 0 or prompts_per_step < 1 or extra < 0:
        raise ValueError(f"need version >= 0, k >= 0, prompts_per_step >= 1, extra >= 0; got {version}, {k}, "
                         f"{prompts_per_step}, {extra}")
    return (k + version + 1) * prompts_per_step + extra


@dataclass(frozen=True)
class TailPolicy:
    """The declared options for long tails (the ``async`` section's ``overprovision``, ``staleness_basis`` and
    ``stale_tail``). The default is the exact bound with nothing extra."""

    overprovision: float = 0.0  #: extra prompts admitted, as a fraction of a step's prompts
    basis: str = OLDEST_TOKEN  #: :data:`OLDEST_TOKEN` or :data:`REQUEST_START`
    stale_tail: str = RESTART  #: :data:`RESTART` or :data:`SETTLE_GROUP`
    #: a prompt starts only on weights its admission step can use (:func:`start_floor`; ``async.start_on_step_weights``)
    step_weights: bool = False

    def __post_init__(self) -> None:
        if self.overprovision < 0 or self.basis not in (OLDEST_TOKEN, REQUEST_START) or \
                self.stale_tail not in (RESTART, SETTLE_GROUP):
            raise ValueError(f"bad tail policy {self}")

    @classmethod
    def from_config(cls, async_cfg: Any) -> TailPolicy:
        """The policy an ``async`` config section declares."""
        return cls(float(async_cfg.overprovision), str(getattr(async_cfg.staleness_basis, "value",
                                                                   async_cfg.staleness_basis)),
                   str(getattr(async_cfg.stale_tail, "value", async_cfg.stale_tail)),
                   bool(getattr(async_cfg, "start_on_step_weights", False)))

    def extra_prompts(self, prompts_per_step: int) -> int:
        """Prompts admitted beyond the bound's ``(k + v + 1) x B``."""
        return math.ceil(self.overprovision * prompts_per_step)

    def extra_rows(self, prompts_per_step: int, n: int) -> int:
        """Store rows the extra prompts may keep live."""
        return self.extra_prompts(prompts_per_step) * n


def tail_policy(run: Any) -> TailPolicy:
    """The tail policy of ``run`` (a :class:`~asyncflow_core.flow.stage.FlowContext`; anything without a ``tail``
    attribute, such as a test's stand-in, has the default)."""
    return getattr(run, "tail", None) or TailPolicy()


def check_tail_policy(tail: TailPolicy, k: int, correction: Any) -> str | None:
    """What is wrong with ``tail`` for bound ``k`` and the algorithm's off-policy ``correction`` (None: nothing).

    Counting a row's age from its request's start (:data:`REQUEST_START`) trains rows whose tokens come from
    several versions; the loss must then anchor its clip on the trainer's own proximal log-probs and weight each
    token by its behaviour log-prob (decoupled PPO), which truncated IS against one behaviour policy does not.
    """
    if tail.basis == REQUEST_START and str(getattr(correction, "value", correction)) != "decoupled":
        return ("async.staleness_basis: request_start trains rows whose tokens come from several policy versions; "
                "set algorithm.options.correction: decoupled (clip against the trainer's proximal log-probs, "
                "per-token IS against the behaviour log-probs), or use staleness_basis: oldest_token")
    if k == 0 and (tail.overprovision > 0 or tail.basis == REQUEST_START):
        return ("async.overprovision and async.staleness_basis: request_start need max_staleness >= 1 (at k = 0 a "
                "group carried to the next step is always stale); use mode: one_step or async")
    return None


def is_fresh(step_version: int, min_version: torch.Tensor | int, k: int) -> torch.Tensor | bool:
    """True where a row of ``min_version`` may be used in the step that starts at ``step_version``."""
    return (step_version - min_version) <= k


def oldest_usable(step_version: int, k: int) -> int:
    """The oldest ``min_version`` step ``step_version`` (or any later step) can still use."""
    return step_version - k


def start_floor(position: int, prompts_per_step: int, k: int, version: int) -> int:
    """The oldest weights a prompt should start on: the ``position``-th admission (0-based, net of dropped
    prompts) is for step ``position // prompts_per_step``, which uses rows of version ``step - k`` or newer.

    Capped at the trainer's ``version`` at admission (weights that exist; over-provisioned prompts beyond the
    bound's ``k + 1`` steps get that cap). A prompt started on older weights can only be trained earlier than its
    step, and is otherwise aborted and started again: what the runtime avoids by holding it until a replica has
    these weights (:attr:`TailPolicy.step_weights`). The bound itself does not depend on it."""
    return max(0, min(position // prompts_per_step - k, version))


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
        self.tail = tail_policy(run)

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

    def counted_version(self, oldest_token_version: int | None, origin_version: int | None) -> int | None:
        """The version a row's age counts from: its oldest token's, or under :data:`REQUEST_START` the version its
        request started on when that is older (None: no tokens and no start)."""
        if self.tail.basis != REQUEST_START or origin_version is None:
            return oldest_token_version
        return origin_version if oldest_token_version is None else min(origin_version, oldest_token_version)

    def to_abort(self, inflight: Mapping[str, Any], version: int | None = None) -> list[str]:
        """Request ids of ``inflight`` (id -> request with a ``start_version``) that are unusable at ``version``
        (default: the trainer's current one)."""
        v = self.run.version if version is None else version
        return [rid for rid, q in inflight.items()
                if must_abort(self.counted_version(q.start_version, getattr(q, "origin_version", None)), v,
                              self.run.k)]
