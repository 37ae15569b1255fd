"""How a multi-turn episode keeps going when its environment is lost or its turns must be re-based.

A mixin of :class:`~asyncflow_core.flow.multi_turn.MultiTurn`, with what it
records per step (:class:`TakenStep`: the action handed to ``step``, the
tokens appended after it, the reward and the step's tool figures).

- **Lost environment** (its worker process exited, or was restarted after
  another episode's time-out: the pool's ``PooledEnvironment.lost``): an
  environment that declares ``features.restore == "replay"`` is rebuilt: a
  fresh one gets ``reset(record, seed)`` and every recorded action again, and
  must answer with the same rendered observations, rewards and ``done=False``
  (a difference fails the episode: ``environment replay diverged at ...``);
  then the lost step is run again. The sampled turns are kept. With
  ``restore == "reset"`` the episode starts again from ``reset`` (its turns
  thrown away). Either way at most ``EpisodeSettings.max_env_rebuilds``
  times per episode; the next loss fails it with the reason.
- **Stale turns** (the stage's ``_stale`` under ``stale_policy: requeue``):
  with ``replay`` the longest prefix of turns whose sampled tokens are all
  still inside the bound is kept and replayed (:meth:`Recovery.fresh_turns`);
  with ``reset``, or when the first turn is out of the bound (the usual case:
  turns are sampled in order, so the first is the oldest), it starts from
  ``reset``.
- **Tool errors**: a step whose ``info["reason"]`` is set (a malformed call
  or answer) is counted per episode (``Trajectory.info["tool_errors"]`` and
  its reasons), on the step's timeline span (``tool_error``) and in the run's
  counters (``episode_tool_errors`` and ``tool_error: <reason>``, at most
  :data:`MAX_REASON_KEYS` distinct reasons, the rest under
  ``tool_error: (other reasons)``). Replayed steps are not counted again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncflow_core.flow.render import RenderError
from asyncflow_core.interfaces.environment import RESTORE_REPLAY, Action, Observation
from asyncflow_core.types.episode import Segment

__all__ = ["EpisodeFailed", "MAX_REASON_KEYS", "Recovery", "ReplayMismatch", "TakenStep", "merge_events",
           "step_reason"]

#: distinct ``tool_error: <reason>`` counters a run keeps (the reasons may quote the model's text)
MAX_REASON_KEYS = 32
#: per-episode distinct reasons kept in ``Trajectory.info["tool_error_reasons"]``
MAX_EPISODE_REASONS = 8
_REASON_CHARS = 120
OTHER_REASONS = "tool_error: (other reasons)"


class EpisodeFailed(Exception):
    """An environment call failed; the message is the recorded reason."""


class ReplayMismatch(EpisodeFailed):
    """A replayed environment answered differently from the recorded episode."""


@dataclass(frozen=True)
class TakenStep:
    """One ``step`` the episode took: what replay repeats and checks, and the step's figures."""

    action: Action
    observed: tuple[int, ...]  #: tokens appended after the turn (template glue + the observation); () when final
    reward: float
    final: bool  #: the step ended the episode (done, or the turn limit): never replayed
    tool_calls: int = 0
    tool_ok: int = 0
    tool_s: float | None = None
    correct: float | None = None
    reason: str | None = None  #: the step's ``info["reason"]`` (first line), when it gave one


def step_reason(info: Any) -> str | None:
    """A step's ``info["reason"]`` as one short line (None: no reason given)."""
    if not isinstance(info, Mapping):
        return None
    value = info.get("reason")
    if value is None or value is False:
        return None
    text = str(value).strip()
    line = text.splitlines()[0] if text else ""
    if not line:
        return None
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."


def merge_events(counters: Counter[str], events: Counter[str]) -> None:
    """Add an episode's events to the run's counters, at most :data:`MAX_REASON_KEYS` distinct tool-error reasons."""
    for key, n in events.items():
        if key.startswith("tool_error: ") and key not in counters and key != OTHER_REASONS:
            if sum(1 for k in counters if k.startswith("tool_error: ") and k != OTHER_REASONS) >= MAX_REASON_KEYS:
                key = OTHER_REASONS
        counters[key] += n
    events.clear()


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Recovery:
    """Replay, rebuild and tool-error figures of a multi-turn episode (see the module docstring)."""

    settings: Any
    env: Any
    row: int
    record: Any
    seed: int
    prompt: tuple[int, ...]
    tools: tuple[Any, ...]
    history: tuple[Any, ...]
    prompt_stored: tuple[int, ...]
    segments: list[Segment]
    turn_rewards: list[float]
    origin_version: int | None
    failure: str | None
    cut: str | None
    restarts: int
    rebuilds: int
    restore: str
    events: Counter[str]
    _steps: list[TakenStep]
    _context: list[int]
    _oldest: int | None
    _finish: Any
    _env_s: float
    _env_call: Any
    _fail: Any
    begin: Any
    advance: Any
    close: Any

    # -- the environment lost ------------------------------------------------------------------------

    def _lost(self) -> str | None:
        """Why the environment object is gone (its worker process exited or was restarted), else None."""
        lost = getattr(self.env, "lost", None)
        return lost if isinstance(lost, str) and lost else None

    def _may_rebuild(self, lost: str | None) -> bool:
        return lost is not None and self.rebuilds < self.settings.max_env_rebuilds

    def _lost_reason(self, why: str, lost: str | None) -> str:
        if lost is None:
            return why
        n = self.rebuilds + 1
        return (f"{why} (its environment was lost {n} time{'s' if n > 1 else ''}; "
                f"EpisodeSettings.max_env_rebuilds={self.settings.max_env_rebuilds})")

    async def _recover(self, exc: EpisodeFailed) -> Any:
        """A step failed: rebuild a lost environment (replay, then the step again) or restart; else fail."""
        lost = self._lost()
        if not self._may_rebuild(lost):
            return self._fail(self._lost_reason(str(exc), lost))
        self.rebuilds += 1
        self.events["env_lost"] += 1
        await self.close()
        if self.restore == RESTORE_REPLAY:
            self.events["env_replayed"] += 1
            progress = await self.begin()  # a fresh environment, reset and the recorded actions replayed
            if progress.value != "continue":
                return progress
            return await self.advance()  # the lost step, again
        self.events["restarted_env_lost"] += 1
        self.restart()
        return await self.begin()

    # -- stale turns -------------------------------------------------------------------------------------

    def fresh_turns(self, unusable: Callable[[int | None], bool]) -> int:
        """How many leading turns a restart keeps (replayed): 0 unless ``restore == "replay"``; else the longest
        prefix of replayable turns whose sampled tokens are all usable (and, under ``staleness_basis:
        request_start``, none when the episode's start is not)."""
        if self.restore != RESTORE_REPLAY or unusable(self.origin_version):
            return 0
        kept = 0
        for t, taken in enumerate(self._steps):
            versions = [v for x in self.segments if x.sampled and x.turn == t for v in x.versions]
            if taken.final or (versions and unusable(min(versions))):
                break
            kept = t + 1
        return kept

    # -- replay ------------------------------------------------------------------------------------------

    def _check_prompt(self, prompt: list[int], tools: tuple[Any, ...]) -> None:
        """Raise :class:`ReplayMismatch` unless a fresh ``reset`` rendered the recorded prompt and tools."""
        if tools != tuple(self.tools):
            self.events["replay_mismatch"] += 1
            raise ReplayMismatch("environment replay diverged at reset: its tools differ from the recorded ones")
        if tuple(prompt) != tuple(self.prompt):
            self.events["replay_mismatch"] += 1
            at = _first_difference(tuple(prompt), tuple(self.prompt))
            raise ReplayMismatch(f"environment replay diverged at reset: the first observation renders to "
                                 f"{len(prompt)} tokens, the recorded prompt has {len(self.prompt)} (first "
                                 f"difference at token {at})")

    async def _replay(self) -> None:
        """Step a freshly reset environment through the recorded actions; each answer must be the recorded one."""
        for taken in self._steps:
            turn = taken.action.turn
            step = await self._env_call(f"replay {turn}", lambda a=taken.action: self.env.step(a))
            if not hasattr(step, "done") or not hasattr(step, "observation"):
                raise EpisodeFailed(f"environment replay of step {turn} returned {type(step).__name__}, not a Step")
            what = None
            if step.done:
                what = "the step ended the episode (done); the recorded one did not"
            elif not isinstance(step.observation, Observation):
                what = "the step returned no observation"
            elif float(step.reward) != taken.reward:
                what = f"reward {float(step.reward)!r}, recorded {taken.reward!r}"
            else:
                seg = next(x for x in self.segments if x.sampled and x.turn == turn)
                observed = tuple(self._render_step(step, seg))
                if observed != taken.observed:
                    at = _first_difference(observed, taken.observed)
                    what = (f"the observation renders to {len(observed)} tokens, recorded {len(taken.observed)} "
                            f"(first difference at token {at})")
            if what is not None:
                self.events["replay_mismatch"] += 1
                raise ReplayMismatch(f"environment replay diverged at step {turn}: {what}")

    # -- turns kept, rendered again ------------------------------------------------------------------------

    def retry_turn(self) -> None:
        """Start the current turn again without its partial tokens; the earlier turns (and the episode's start,
        ``origin_version``) stay."""
        origin = self.origin_version
        super().retry_turn()
        self.origin_version = origin

    def restart(self, keep: int = 0) -> None:
        """Start the episode again (a new environment: call :meth:`close` first), as a new request: from ``reset``,
        or keeping its first ``keep`` turns, which :meth:`begin` then replays (:meth:`fresh_turns`)."""
        self.retry_turn()
        self.restarts += 1
        keep = max(0, min(keep, len(self._steps)))
        while keep and self._steps[keep - 1].final:
            keep -= 1
        self._steps = self._steps[:keep]
        self.segments = [x for x in self.segments if x.turn < keep]
        self.turn_rewards = self.turn_rewards[:keep]
        self.failure, self.cut, self._finish = None, None, None
        if keep:
            self._context = list(self.prompt) + [t for x in self.segments for t in x.token_ids]
        else:
            self.history, self.tools = (), ()
            self._context, self._env_s = [], 0.0
            self.prompt = self.prompt_stored
            self.origin_version = None  # a new start: its age counts from its new first request
        self._oldest = min((v for x in self.segments if x.sampled for v in x.versions), default=None)

    def _render_step(self, step: Any, seg: Segment) -> list[int]:
        """The tokens appended after sampled turn ``seg``: template glue and ``step``'s observation."""
        s = self.settings
        assert s is not None
        if not isinstance(step.observation, Observation):
            raise RenderError(f"a step that is not done returned {type(step.observation).__name__}, "
                              "not an Observation")
        glue, toks = s.renderer.step(step.observation, history=self.history, tools=self.tools,
                                     ended_by_stop=bool(seg.token_ids) and seg.token_ids[-1] in s.renderer.stop_ids)
        return list(glue) + list(toks)

    # -- tool errors -------------------------------------------------------------------------------------

    def _count_reason(self, reason: str | None) -> None:
        if reason is not None:
            self.events["episode_tool_errors"] += 1
            self.events[f"tool_error: {reason}"] += 1

    def tool_figures(self) -> dict[str, Any]:
        """The episode's tool figures over its recorded steps (``Trajectory.info``)."""
        steps = self._steps
        out: dict[str, Any] = {"tool_calls": sum(s.tool_calls for s in steps),
                               "tool_ok": sum(s.tool_ok for s in steps)}
        reasons = Counter(s.reason for s in steps if s.reason is not None)
        out["tool_errors"] = sum(reasons.values())
        if reasons:
            out["tool_error_reasons"] = dict(reasons.most_common(MAX_EPISODE_REASONS))
        seconds = [s.tool_s for s in steps if s.tool_s is not None]
        if seconds:
            out["tool_s"] = sum(seconds)
        if steps and steps[-1].correct is not None:  # the last step's: an earlier answer does not count
            out["correct"] = steps[-1].correct
        return out
