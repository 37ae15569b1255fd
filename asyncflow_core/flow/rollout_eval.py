"""Evaluation requests on the rollout replicas, pinned to the version each replica holds.

A mixin of :class:`~asyncflow_core.flow.rollout_stage.RolloutStage`. When the
run has an ``eval`` section, ``stage.eval`` is an
:class:`~asyncflow_core.flow.eval.EvalRequests` queue: on every dispatch each
ready replica takes the eval requests of a round pinned to exactly its
weights' version (up to ``eval.priority`` of its slots, the rest stays with
training), and while it serves such a round the weight follower holds its
next load (``hold``), so every token of an evaluation comes from one version.
Eval requests share the replicas' slots with training (the engine pool counts
them), never enter the store, and their results go to the queue, which scores
a round once it is complete.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncflow_core.flow.engine_pool import Replica, ReplicaState
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult


class EvalSlot:
    """What an eval request is in a replica's ``inflight`` map (training requests are episodes)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def training_inflight(r: Replica) -> dict[str, Any]:
    """``r``'s in-flight training requests (its eval requests left out)."""
    return {k: v for k, v in r.inflight.items() if not isinstance(v, EvalSlot)}


class EvalDispatch:
    """Eval dispatch, hold and results of the rollout stage (see the module docstring)."""

    eval: Any = None  #: the run's EvalRequests queue (set by the runtime before the run), or None

    def _eval_hold(self, r: Replica) -> bool:
        """The weight follower keeps ``r`` on its version while it serves an eval round pinned there."""
        return self.eval is not None and not r.dead and self.eval.hold(r.index, r.engine.version)

    def _dispatch_eval(self) -> None:
        queue = self.eval
        if queue is None or not queue.outstanding or self.ctx.stop.is_set():  # type: ignore[attr-defined]
            return
        for r in self.replicas:  # type: ignore[attr-defined]
            if r.state is not ReplicaState.READY or r.asleep:
                continue
            free = self.max_inflight - len(r.inflight)  # type: ignore[attr-defined]
            if free <= 0:
                continue
            # a replica held at its version for this round delays the next weights: let the round use every slot
            urgent = self.ctx.published > r.engine.version  # type: ignore[attr-defined]
            reqs = queue.take(r.index, r.engine.version, free, urgent=urgent)
            if not reqs:
                continue
            for q in reqs:
                self.pool.assign(r, q.request_id, EvalSlot(q.request_id))  # type: ignore[attr-defined]
            self._mark_busy(r)  # type: ignore[attr-defined]
            self._spawn(self._drive_eval(r, reqs))  # type: ignore[attr-defined]

    async def _drive_eval(self, r: Replica, reqs: list[GenerationRequest]) -> None:
        gen = r.generation
        waiting = {q.request_id for q in reqs}
        try:
            async for res in r.engine.generate(reqs):
                waiting.discard(res.request_id)
                if self.pool.release(r, res.request_id) is not None:  # type: ignore[attr-defined]
                    await self.eval.result(r.index, res)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a dying engine must not take the run down
            if r.generation == gen:
                await self.replica_died(r, exc)  # type: ignore[attr-defined]
            return
        for rid in waiting:  # one result per request: a request left without one fails (it would wait forever)
            if self.pool.release(r, rid) is not None:  # type: ignore[attr-defined]
                await self.eval.result(r.index, GenerationResult(rid, (), (), (), (), FinishReason.ERROR,
                                                                 error="the engine returned no result for it"))
        self._mark_busy(r)  # type: ignore[attr-defined]
        self._dispatch()  # type: ignore[attr-defined]
        self._poke()  # type: ignore[attr-defined]
        await self.ctx.notify()  # type: ignore[attr-defined]  # the hold on r's weights may have lifted

    async def _eval_replica_died(self, r: Replica) -> None:
        if self.eval is not None:
            await self.eval.requeue(r.index)

    async def _eval_weights_moved(self) -> None:
        """Rounds pinned to a version no live replica holds any more fail what they have left."""
        if self.eval is None:
            return  # no evaluation: nothing to expire (and no pass over every replica per weight load)
        live = [q.engine.version for q in self.replicas if not q.dead]  # type: ignore[attr-defined]
        if live:
            await self.eval.expire(min(live))
