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
  turn and its environment and tool seconds as the span's args.
"""

from __future__ import annotations

import asyncio
from typing import Any

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

        An episode starts again from ``reset`` with a new environment (its earlier turns are unusable too).
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
            self._begin(req, restart=True)
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

    def _begin(self, ep: Any, *, restart: bool = False) -> None:
        """Open (or, on ``restart``, re-open) the episode's environment and reset it, as a task."""
        self._in_env += 1
        self._spawn(self._reset(ep, restart))

    def _trace_env(self, name: str, args: dict[str, Any]) -> Any:
        """An environment call's span on the lowest free ``env/<k>`` lane of the run's timeline."""
        return self.ctx.timeline.slot_span("env", name, args)

    async def _reset(self, ep: Any, restart: bool) -> None:
        if hasattr(ep, "tracer"):  # a multi-turn episode: its resets and steps go on the timeline
            ep.tracer = self._trace_env
        try:
            if restart:
                await ep.close()
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

    async def _after_env(self, ep: Any, progress: Progress) -> None:
        ctx = self.ctx
        if ctx.stop.is_set():
            self._poke()
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

