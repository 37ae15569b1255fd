"""The rollout stage's handling of requests that fell out of the staleness bound, per the declared tail policy.

A mixin of :class:`~asyncflow_core.flow.rollout_stage.RolloutStage`, before
:class:`~asyncflow_core.flow.rollout_episodes.EpisodeDriving` in its bases:
it counts a request's age as ``async.staleness_basis`` says (its oldest
token, or the version its request started on) and, under ``async.stale_tail:
settle_group``, writes a single-turn tail that fell out of the bound at once
(stale) so its group is re-queued as soon as its siblings are in
(docs/simulation.md, "Tail policies"). It also aborts, on every trainer version,
the in-flight requests that can no longer be used, and sends the requests a
replica was given in one turn of the event loop as one generate call.
"""

from __future__ import annotations

import asyncio

from asyncflow_core.flow.engine_pool import Replica
from asyncflow_core.flow.rollout_eval import training_inflight
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.flow.staleness import SETTLE_GROUP
from asyncflow_core.types import GenerationResult


class TailHandling:
    """Staleness basis and stale tails of the rollout stage (see the module docstring)."""

    #: replica index -> (replica, its generation, requests assigned to it in this turn of the event loop)
    _outbox: dict[int, tuple[Replica, int, list[SingleTurn]]] | None = None

    def _send(self, r: Replica, reqs: list[SingleTurn]) -> None:
        """Start ``reqs`` (already counted in flight on ``r``) on ``r``'s engine at the end of this turn of the loop.

        A dispatch follows every result, and an engine hands over the rows that finished together in one go: each
        freed slot's request went out as a generate call of its own (about 30 calls a step in the example, each
        a task, a call into the engine and a wake-up of its worker). The assignments are made as before, one by
        one; the requests a replica got in one turn of the loop go out in one call.
        """
        if self._outbox is None:
            self._outbox = {}
            asyncio.get_running_loop().call_soon(self._send_due)
        entry = self._outbox.get(r.index)
        if entry is None or entry[1] != r.generation:
            self._outbox[r.index] = (r, r.generation, list(reqs))
        else:
            entry[2].extend(reqs)

    def _send_due(self) -> None:
        box, self._outbox = self._outbox or {}, None
        for r, generation, reqs in box.values():
            # a request re-queued meanwhile (its replica died, the run stopped) is no longer this replica's
            live = [q for q in reqs if r.inflight.get(q.request_id) is q] if r.generation == generation else []
            if live and not self.ctx.stop.is_set():
                self._spawn(self._drive(r, live))

    async def _stale_watch(self) -> None:
        """On every trainer version, abort in-flight requests that can no longer be used."""
        ctx = self.ctx
        seen = ctx.version
        while not ctx.stop.is_set():
            await ctx.wait_for(lambda: ctx.version != seen)
            seen = ctx.version
            for r in self.replicas:
                if r.dead or not r.engine.features.supports_abort:
                    continue
                ids = self.guard.to_abort(training_inflight(r), seen)
                if ids:
                    ctx.counters["aborted_stale"] += len(ids)
                    try:
                        await self.pool.abort(r, ids)
                    except Exception as exc:  # noqa: BLE001
                        await self.replica_died(r, exc)

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
