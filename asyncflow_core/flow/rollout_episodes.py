"""The rollout stage's moves for a row it cannot write yet, and its episodes' environment (or agent) tasks.

A mixin of :class:`~asyncflow_core.flow.rollout_stage.RolloutStage` (it uses
the stage's context, guard, writer, pending list and task spawner):

- an aborted request resumes after its tokens (partial rollout), or starts
  its turn again; a request whose tokens fell out of the staleness bound is
  re-queued from the start or dropped (``async.stale_policy``);
- an episode's ``begin`` (environment reset, or the agent's start) and each
  ``advance`` (environment step, or the agent's next call) run as tasks of
  their own, holding no replica slot; what they decide (next turn, done,
  failed, stale) comes back to the dispatch. Each environment reset and step
  is a span on the timeline's ``env/<k>`` lanes (the lowest lane free when
  the call starts, so concurrent calls never share one), with the row, the
  turn and its environment and tool seconds as the span's args (and a
  step's ``tool_error`` reason when it gave one).

An episode that falls out of the bound under ``stale_policy: requeue`` starts
again from ``reset``, or, when its environment declares ``restore: replay``,
keeps its leading turns that are still inside the bound and replays them
(flow/episode_recovery.py; counted ``replayed_stale_episode`` beside
``requeued_stale_episode``). What an episode counted while it ran (lost and
rebuilt environments, replay mismatches, tool errors and their reasons) goes
to the run's counters after each of its environment calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncflow_core.flow.episode_recovery import merge_events
from asyncflow_core.flow.multi_turn import Progress
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.types import GenerationResult
from asyncflow_core.types.episode import Trajectory

__all__ = ["EpisodeDriving"]


class EpisodeDriving:
    """Requeue, resume and episode tasks for the rollout stage (see the module docstring)."""

    name: str
    ctx: Any
    guard: Any
    writer: Any
    _pending: list[SingleTurn]
    _in_env: int
    _open: set[Any]
    _tasks: set[asyncio.Task]
    _closing: set[asyncio.Task]
    _task_done: Any
    _spawn: Any  #: the stage's task spawner, ``_dispatch`` and ``_poke`` (its methods)
    _dispatch: Any
    _poke: Any

    def _resubmit(self, r: Any, req: SingleTurn, res: GenerationResult) -> None:
        ctx = self.ctx
        fresh_prefix = not self.guard.unusable(req.oldest_with(res))
        if len(res.token_ids) and fresh_prefix and r.engine.features.supports_resume_prefix:
            req.resume(res)
            ctx.counters["resumed_partial"] += 1
            self._pending.append(req)
        elif not fresh_prefix:
            self._stale(req)
        else:
            req.retry_turn()
            ctx.counters["restarted_abort"] += 1
            self._pending.append(req)

    def _stale(self, req: SingleTurn) -> None:
        """A generation that can no longer be used: start it again on fresh weights (requeue) or drop its group.

        An episode starts again with a new environment: from ``reset`` (its earlier turns are unusable too), or
        replaying its leading turns that are still usable when its environment declares ``restore: replay``.
        """
        ctx = self.ctx
        if ctx.stale_policy == "drop":
            ctx.outcomes.stale(req.row)
            if req.multi_turn:
                ctx.counters["dropped_stale_episode"] += 1
            self._spawn(self._settle(req, None))
            return
        if req.multi_turn:
            ctx.counters["requeued_stale_episode"] += 1
            fresh = getattr(req, "fresh_turns", None)
            keep = fresh(self.guard.unusable) if fresh is not None else 0
            if keep:
                ctx.counters["replayed_stale_episode"] += 1
            self._begin(req, restart=True, keep=keep)
            return
        req.restart()
        ctx.counters["requeued_stale_rollout"] += 1
        self._pending.append(req)

    # -- episodes: their environment calls run as tasks, holding no replica slot ----------------------

    async def _settle(self, req: SingleTurn, out: GenerationResult | Trajectory | None) -> None:
        """Write the row (None: a placeholder for a row settled without a result) and close its environment."""
        await self.writer.write(req, out)
        if req.multi_turn:
            self._open.discard(req)
            task = asyncio.ensure_future(req.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _begin(self, ep: Any, *, restart: bool = False, keep: int = 0) -> None:
        """Open (or, on ``restart``, re-open) the episode's environment and reset it, as a task; ``keep``: the
        leading turns the restart keeps (replayed)."""
        self._in_env += 1
        self._spawn(self._reset(ep, restart, keep))

    def _trace_env(self, name: str, args: dict[str, Any]) -> Any:
        """An environment call's span on the lowest free ``env/<k>`` lane of the run's timeline."""
        return self.ctx.timeline.slot_span("env", name, args)

    async def _reset(self, ep: Any, restart: bool, keep: int = 0) -> None:
        if hasattr(ep, "tracer"):  # a multi-turn episode: its resets and steps go on the timeline
            ep.tracer = self._trace_env
        try:
            if restart:
                await ep.close()
                if keep:
                    ep.restart(keep)
                else:
                    ep.restart()
            self._open.add(ep)
            progress = await ep.begin()
        finally:
            self._in_env -= 1
        await self._after_env(ep, progress)

    async def _step(self, ep: Any) -> None:
        try:
            progress = await ep.advance()
        finally:
            self._in_env -= 1
        await self._after_env(ep, progress)

    async def _keep_lease(self, ep: Any) -> bool:
        """Renew the episode's row lease once per turn; a store call only once half the lease has passed (an
        episode may hold its row longer than ``pipeline.lease_s``). A lease already gone (one turn outlasted half
        of it, or the store freed it) may be leased again: the run stops rather than generate the row twice."""
        keeper = getattr(ep.lease, "keeper", None)
        if keeper is None or await keeper.renew():
            return True
        self.ctx.halt(f"the lease on row {ep.row} ended before its episode did (a turn, generation and environment "
                      f"step, took longer than half of pipeline.lease_s={keeper.lease_s:g}s, or the store freed the "
                      "lease); raise pipeline.lease_s")
        return False

    async def _after_env(self, ep: Any, progress: Progress) -> None:
        ctx = self.ctx
        events = getattr(ep, "events", None)
        if events:
            merge_events(ctx.counters, events)
        if ctx.stop.is_set():
            self._poke()
            return
        if not await self._keep_lease(ep):
            return
        if progress is Progress.FAILED:
            ctx.counters["episodes_failed"] += 1
            ctx.fail_rows(self.name, [ep.row], ep.failure or "episode failed")
            await self._settle(ep, None)
        elif self.guard.unusable(ep.oldest_version()):  # the trainer moved on while the environment stepped
            self._stale(ep)
        elif progress is Progress.DONE:
            ctx.counters["episodes_done"] += 1
            ctx.counters["episode_turns"] += ep.turn
            await self._settle(ep, ep.trajectory())
        else:
            self._pending.insert(0, ep)  # a running episode's next turn goes before new rows
        self._dispatch()
        self._poke()

