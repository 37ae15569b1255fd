"""The rollout stage's handling of requests that fell out of the staleness bound, per the declared tail policy.

A mixin of :class:`~asyncflow_core.flow.rollout_stage.RolloutStage`, before
:class:`~asyncflow_core.flow.rollout_episodes.EpisodeDriving` in its bases:
it counts a request's age as ``async.staleness_basis`` says (its oldest
token, or the version its request started on) and, under ``async.stale_tail:
settle_group``, writes a single-turn tail that fell out of the bound at once
(stale) so its group is re-queued as soon as its siblings are in
(docs/simulation.md, "Tail policies").
"""

from __future__ import annotations

from asyncflow_core.flow.engine_pool import Replica
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.flow.staleness import SETTLE_GROUP
from asyncflow_core.types import GenerationResult


class TailHandling:
    """Staleness basis and stale tails of the rollout stage (see the module docstring)."""

    def _unusable(self, req: SingleTurn, res: GenerationResult) -> bool:
        """Whether ``req`` with ``res`` taken in is outside the bound, counted as ``async.staleness_basis`` says."""
        return self.guard.unusable(self.guard.counted_version(req.oldest_with(res), req.origin_version))

    def _resubmit(self, r: Replica, req: SingleTurn, res: GenerationResult) -> None:
        """An aborted request: out of the bound (counted per the basis) it is stale; otherwise resumed or restarted
        (``EpisodeDriving._resubmit``)."""
        if self._unusable(req, res):
            self._stale(req, res)
        else:
            super()._resubmit(r, req, res)

    def _stale(self, req: SingleTurn, res: GenerationResult | None = None) -> None:
        """A request outside the bound. With ``async.stale_tail: settle_group`` (and ``stale_policy: requeue``) a
        single-turn one is written at once with the tokens it has, whose versions keep it outside the bound, so
        the trainer re-queues its whole group as soon as the siblings are in, instead of waiting for a new
        generation of this row that the group could never train on; otherwise ``EpisodeDriving._stale``."""
        if (res is not None and not req.multi_turn and self.guard.tail.stale_tail == SETTLE_GROUP
                and self.ctx.stale_policy == "requeue" and self._unusable(req, res)):
            self.ctx.counters["settled_stale_tail"] += 1
            self._spawn(self._settle(req, res))
            return
        super()._stale(req)
