"""The multi-turn episode: a conversation with an environment, one generation request per turn.

:class:`MultiTurn` runs with an
:class:`~asyncflow_core.interfaces.environment.Environment`. ``reset`` with
the row's record gives the first observation, rendered once into the
prompt (the stored ``prompt_ids`` when it *is* the dataset's prompt); each
turn's request has every token so far as its prompt (token ids only, never
re-encoded); the engine's tokens are appended as a sampled
:class:`~asyncflow_core.types.episode.Segment` exactly as returned; the
action (those tokens, and their text decoded once) goes to ``step``; the
next observation is rendered once (flow/render.py) and appended as an
observed segment. The episode ends when the environment says ``done``, at
``max_turns`` (written, ``truncated``), or fails with a recorded reason (an
environment exception, a step over ``step_timeout_s``, an observation that
cannot be rendered, or an episode over ``max_episode_tokens``).

Staleness across turns: an episode is as old as its oldest sampled token.
Every request of a turn starts no newer than the episode's oldest token
(``held_versions``), so the stage's in-flight abort and its check of each
result cover the whole episode; an episode whose earlier turns fall out of
the bound starts again (or is dropped under ``stale_policy: drop``). Under
``async.staleness_basis: request_start`` its age counts from the version its
first turn's request started on (``origin_version``, kept across turns,
resumes and turn retries; cleared when it starts again from ``reset``).

Recovery (flow/episode_recovery.py): every step taken is recorded; an
environment declaring ``restore: replay`` is rebuilt from ``reset`` and the
recorded actions when it is lost (and on a restart that keeps turns), with
the observations checked; ``restore: reset`` starts the episode again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from asyncflow_core import columns as C
from asyncflow_core.errors import AsyncflowError
from asyncflow_core.flow.env_values import (awaitable, count_of, finite_number, is_dataset_prompt, record_for_env,
                                             untraced)
from asyncflow_core.flow.episode_recovery import EpisodeFailed, Recovery, ReplayMismatch, TakenStep, step_reason
from asyncflow_core.flow.render import Renderer, RenderError
from asyncflow_core.flow.single_turn import SingleTurn, as_tuple
from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT
from asyncflow_core.interfaces.environment import RESTORE_RESET, Action, Observation, ToolSpec
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from asyncflow_core.types.episode import Segment, Trajectory

log = logging.getLogger("asyncflow.flow")

__all__ = ["EnvCallTracer", "EnvOpener", "EpisodeSettings", "MultiTurn", "MultiTurnEpisodes", "Progress"]


class Progress(enum.Enum):
    """What an episode's environment step decided."""

    CONTINUE = "continue"  #: the next observation is appended: dispatch the next turn
    DONE = "done"  #: the episode is over: write it
    FAILED = "failed"  #: the episode failed: :attr:`MultiTurn.failure` says why


#: Opens one episode's environment (a fresh object per episode: the plugin factory, or the environment pool's).
EnvOpener = Callable[[], "Environment | Awaitable[Environment]"]
#: Traces one environment call: ``tracer(name, args)`` is a context manager around the call yielding ``args``,
#: which the episode completes before it exits (the run's ``Timeline.slot_span`` on the ``env`` lanes).
EnvCallTracer = Callable[[str, dict[str, Any]], contextlib.AbstractContextManager[dict[str, Any]]]


@dataclass
class EpisodeSettings:
    """What every multi-turn episode of a run shares."""

    open_env: EnvOpener
    renderer: Renderer
    decode: Callable[[Sequence[int]], str]  #: the run's tokenizer's decode (an action's text, decoded once)
    max_turns: int = 8
    max_episode_tokens: int | None = None  #: prompt + response; None: no limit beyond each turn's max_new_tokens
    step_timeout_s: float | None = 60.0  #: per reset/step; None: no limit
    owns_reward: bool = False
    seed: int = 0
    #: times one episode's environment may be lost (worker exited or restarted) and rebuilt or restarted;
    #: the next loss fails the episode with the reason
    max_env_rebuilds: int = 2

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_env_rebuilds < 0:
            raise ValueError(f"max_env_rebuilds must be >= 0, got {self.max_env_rebuilds}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 2:
            raise ValueError(f"max_episode_tokens must be >= 2, got {self.max_episode_tokens}")


@dataclass(eq=False)  # the stage keeps a set of the episodes with an open environment
class MultiTurn(Recovery, SingleTurn):
    """An episode with an environment: requests per turn, steps between them, a :class:`Trajectory` at the end."""

    multi_turn: ClassVar[bool] = True

    settings: EpisodeSettings | None = None
    record: Any = None  #: the dataset row (a PromptRecord or a mapping) ``reset`` starts from
    seed: int = 0  #: ``reset``'s seed: the same for the samples of a group and for every restart
    env: Any = None
    segments: list[Segment] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    history: tuple[Mapping[str, Any], ...] = ()  #: the first observation's messages (the template's context)
    tools: tuple[ToolSpec, ...] = ()
    failure: str | None = None  #: why the episode failed (a one-line reason), once it has
    cut: str | None = None  #: why it ended without ``done`` (``max_turns``)
    restarts: int = 0
    rebuilds: int = 0  #: times its environment was lost and rebuilt (replay) or restarted (reset)
    restore: str = RESTORE_RESET  #: what its environment declares (``features.restore``)
    events: Counter = field(default_factory=Counter)  #: for the run's counters (the stage drains them)
    prompt_stored: tuple[int, ...] = ()  #: the row's stored prompt ids (a restart renders the prompt again from them)
    _context: list[int] = field(default_factory=list)  #: prompt + every segment's tokens: the next request's prompt
    _oldest: int | None = None  #: oldest version among the sampled tokens
    _finish: FinishReason | None = None  #: how the last sampled turn ended
    _steps: list[TakenStep] = field(default_factory=list)  #: every step taken, in order (replay repeats them)
    _env_s: float = 0.0
    #: traces each reset and step (the rollout stage sets it to its timeline's ``env`` lanes)
    tracer: EnvCallTracer | None = None

    # -- requests --------------------------------------------------------------------------------

    @property
    def turn(self) -> int:
        """Index of the turn being sampled (= turns taken)."""
        return len(self.turn_rewards)

    @property
    def request_id(self) -> str:
        return f"row{self.row}-try{self.attempt}-turn{self.turn}"

    @property
    def context_len(self) -> int:
        return len(self._context)

    def request(self, sampling: SamplingParams) -> GenerationRequest:
        s = self.settings
        assert s is not None
        if s.max_episode_tokens is not None:  # a turn never runs past the episode's budget
            room = s.max_episode_tokens - len(self._context)
            if room < sampling.max_new_tokens:
                sampling = replace(sampling, max_new_tokens=max(1, room))
        return GenerationRequest(
            request_id=self.request_id, prompt_token_ids=tuple(self._context), sampling=sampling,
            prefix_token_ids=self.prefix_ids, prefix_logprobs=self.prefix_lps, prefix_versions=self.prefix_versions,
        )

    def held_versions(self) -> Sequence[int]:
        held = min(self.prefix_versions, default=None)
        if self._oldest is not None:
            held = self._oldest if held is None else min(held, self._oldest)
        return () if held is None else (held,)

    def oldest_version(self) -> int | None:
        """The version the episode's age counts from: the oldest among the tokens sampled so far (earlier turns
        and the resumed prefix), or its start when ``origin_version`` is set (``staleness_basis:
        request_start``) and older."""
        held = self.held_versions()
        oldest = held[0] if held else None
        if self.origin_version is None:
            return oldest
        return self.origin_version if oldest is None else min(oldest, self.origin_version)

    def oldest_with(self, res: GenerationResult) -> int | None:
        lo = res.min_version
        if self._oldest is None:
            return lo
        return self._oldest if lo is None else min(lo, self._oldest)

    # -- the episode's life --------------------------------------------------------------------

    async def _env_call(self, what: str, call: Callable[[], Awaitable[Any]], *, timed: bool = True) -> Any:
        """``call()`` under the per-step timeout; a failure raises :class:`_Failed` with the reason.

        ``timed`` calls (reset and steps) count in the episode's environment seconds and are traced. Their
        seconds are the environment pool's own timing of the call (measured inside the worker process when the
        environment lives in one) when the environment has ``timings``, else the await's wall time.
        """
        s = self.settings
        assert s is not None
        if not timed:
            return await self._guarded(what, call, None)
        kind, _, turn = what.partition(" ")
        args: dict[str, Any] = {"row": self.row, **({"turn": int(turn)} if turn else {})}
        timings = getattr(self.env, "timings", None)
        n0 = len(timings) if isinstance(timings, list) else None
        with (self.tracer or untraced)(kind, args):
            t0 = time.perf_counter()
            try:
                value = await self._guarded(what, call, s.step_timeout_s)
                info = getattr(value, "info", None)
                tool_s = finite_number(info.get("tool_seconds")) if isinstance(info, Mapping) else None
                if tool_s is not None:
                    args["tool_s"] = tool_s
                reason = step_reason(info)
                if reason is not None:
                    args["tool_error"] = reason
                return value
            finally:
                seconds = time.perf_counter() - t0
                if n0 is not None and len(timings) > n0:  # type: ignore[arg-type]
                    seconds = sum(float(t.seconds) for t in timings[n0:])  # type: ignore[index]
                self._env_s += seconds
                args["env_s"] = seconds

    async def _guarded(self, what: str, call: Callable[[], Awaitable[Any]], timeout: float | None) -> Any:
        try:
            if timeout is None:
                return await call()
            return await asyncio.wait_for(call(), timeout)
        except asyncio.TimeoutError:
            raise _Failed(f"environment {what} took longer than {timeout:g}s (the per-step timeout)") from None
        except asyncio.CancelledError:
            raise
        except AsyncflowError as exc:  # EnvironmentFailure and friends: their message is the reason
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            # the environment pool's own failures name the call already ("environment step (turn N) failed: ...")
            raise _Failed(line if line.startswith("environment ") else f"environment {what}: {line}") from None
        except Exception as exc:  # noqa: BLE001 - an environment's bug is that episode's recorded failure
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise _Failed(f"environment {what} raised {type(exc).__name__}: {first}") from None

    def _fail(self, why: str) -> Progress:
        self.failure = why
        return Progress.FAILED

    async def begin(self) -> Progress:
        """Open the environment, ``reset`` it with the row's record and render the prompt; when the episode has
        recorded steps (a rebuild, or a restart that keeps turns), replay them and check the answers."""
        s = self.settings
        assert s is not None
        while True:
            try:
                # opening waits for a free environment slot (environment.workers): not a step, so not under its timeout
                self.env = await self._env_call("open", awaitable(s.open_env), timed=False)
                return await self._start()
            except ReplayMismatch as exc:
                return self._fail(str(exc))
            except _Failed as exc:
                lost = self._lost()
                if not self._may_rebuild(lost):
                    return self._fail(self._lost_reason(str(exc), lost))
                self.rebuilds += 1  # lost during reset or replay: a fresh one
                self.events["env_lost"] += 1
                await self.close()
            except RenderError as exc:
                return self._fail(f"the first observation could not be rendered: {exc}")

    async def _start(self) -> Progress:
        s = self.settings
        assert s is not None
        obs = await self._env_call("reset", lambda: self.env.reset(record_for_env(self.record), seed=self.seed))
        if not isinstance(obs, Observation):
            raise _Failed(f"environment reset returned {type(obs).__name__}, not an Observation")
        self.restore = str(getattr(getattr(self.env, "features", None), "restore", RESTORE_RESET))
        tools = tuple(self.env.tools or ())
        history = tuple(obs.messages or ())
        if is_dataset_prompt(self.record, self.prompt, obs, tools):
            prompt = list(self.prompt)  # the feeder's tokens: rendered once, already
        else:
            prompt = s.renderer.reset(obs, tools)
        if self.segments:  # rebuilding, turns kept: the same prompt, then every recorded step again
            self._check_prompt(prompt, tools)
            await self._replay()
            return Progress.CONTINUE
        self.tools, self.history = tools, history
        if not prompt:
            return self._fail("the environment's first observation rendered to no tokens")
        self.prompt = tuple(prompt)
        self._context = list(prompt)
        if s.max_episode_tokens is not None and len(prompt) >= s.max_episode_tokens:
            return self._fail(f"oversize episode: the first observation is {len(prompt)} tokens, leaving no room "
                              f"under max_episode_tokens={s.max_episode_tokens}")
        return Progress.CONTINUE

    def take_turn(self, res: GenerationResult) -> None:
        """Append a finished turn (stop or length) as the engine returned it."""
        seg = Segment(as_tuple(res.token_ids), sampled=True, logprobs=as_tuple(res.logprobs),
                      versions=as_tuple(res.versions), turn=self.turn)
        self.segments.append(seg)
        self._context.extend(seg.token_ids)
        lo = res.min_version
        if lo is not None:
            self._oldest = lo if self._oldest is None else min(self._oldest, lo)
        self._finish = res.finish_reason
        self.prefix_ids, self.prefix_lps, self.prefix_versions = (), (), ()

    async def advance(self) -> Progress:
        """Hand the last sampled turn to ``step``; append the next observation (or end the episode)."""
        s = self.settings
        assert s is not None and self.segments and self.segments[-1].sampled
        seg = self.segments[-1]
        action = Action(token_ids=seg.token_ids, text=s.decode(seg.token_ids),
                        finish_reason="length" if self._finish is FinishReason.LENGTH else "stop", turn=seg.turn)
        try:
            step = await self._env_call(f"step {seg.turn}", lambda: self.env.step(action))
        except _Failed as exc:
            return await self._recover(exc)  # a lost environment is rebuilt (or the episode restarted)
        if not hasattr(step, "done") or not hasattr(step, "observation"):
            return self._fail(f"environment step {seg.turn} returned {type(step).__name__}, not a Step")
        try:
            reward = float(step.reward)
        except (TypeError, ValueError):
            return self._fail(f"environment step {seg.turn} returned a reward that is not a number: {step.reward!r}")
        info = step.info if isinstance(step.info, Mapping) else {}
        reason = step_reason(info)
        self._count_reason(reason)
        taken = dict(action=action, reward=reward, tool_calls=count_of(info.get("tool_calls", 0)),
                     tool_ok=count_of(info.get("tool_ok", 0)), tool_s=finite_number(info.get("tool_seconds")),
                     correct=finite_number(info.get("correct")), reason=reason)
        self.turn_rewards.append(reward)
        final = bool(step.done) or len(self.turn_rewards) >= s.max_turns
        if final:
            self._steps.append(TakenStep(observed=(), final=True, **taken))
            if not step.done:
                self.cut = "max_turns"
            return Progress.DONE
        try:
            obs = tuple(self._render_step(step, seg))
        except RenderError as exc:
            self._steps.append(TakenStep(observed=(), final=True, **taken))
            return self._fail(f"the observation after turn {seg.turn} could not be rendered: {exc}")
        self._steps.append(TakenStep(observed=obs, final=False, **taken))
        if obs:
            self.segments.append(Segment(obs, sampled=False, turn=seg.turn))
            self._context.extend(obs)
        if s.max_episode_tokens is not None and len(self._context) >= s.max_episode_tokens:
            return self._fail(f"oversize episode: {len(self._context)} tokens after turn {seg.turn}'s observation, "
                              f"no room under max_episode_tokens={s.max_episode_tokens}")
        return Progress.CONTINUE

    def trajectory(self) -> Trajectory:
        s = self.settings
        assert s is not None
        n = sum(len(x.token_ids) for x in self.segments)
        masked = sum(len(x.token_ids) for x in self.segments if not x.sampled)
        info = {"turns": self.turn, "env_s": self._env_s, "masked_frac": masked / n if n else 0.0,
                "restarts": self.restarts, "env_rebuilds": self.rebuilds,
                "truncated": self._finish is FinishReason.LENGTH or self.cut is not None, **self.tool_figures()}
        if self.cut:
            info["cut"] = self.cut
        return Trajectory(prompt_ids=self.prompt, segments=list(self.segments), turn_rewards=list(self.turn_rewards),
                          reward=sum(self.turn_rewards) if s.owns_reward else None, info=info)

    async def close(self) -> None:
        """Close the environment (once; errors are logged, never raised)."""
        env, self.env = self.env, None
        if env is None:
            return
        try:
            await asyncio.wait_for(env.close(), self.settings.step_timeout_s if self.settings else None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("episode of row %d: environment close failed: %s: %s", self.row, type(exc).__name__, exc)


_Failed = EpisodeFailed  #: an environment call failed; the message is the recorded reason


class MultiTurnEpisodes:
    """The episode factory for an environment: one :class:`MultiTurn` per prompt row."""

    multi_turn = True

    def __init__(self, settings: EpisodeSettings) -> None:
        self.settings = settings
        self.columns: tuple[str, ...] = ROLLOUT_OUT + C.EPISODE_COLUMNS + ((C.REWARD,) if settings.owns_reward else ())

    def new(self, row: int, lease: Any, prompt: tuple[int, ...], group: int, ctx: Any) -> MultiTurn:
        info = ctx.ledger.groups.get(group) if ctx is not None else None
        record = info.record if info is not None else None
        uid = info.prompt_uid if info is not None else group
        seed = (self.settings.seed * 1_000_003 + uid) % (2**31)  # one start per prompt: its samples face one task
        return MultiTurn(row, lease, prompt, group, settings=self.settings, record=record, seed=seed,
                         prompt_stored=prompt)

    async def close(self) -> None:
        """Release what the factory holds (an environment pool's workers, when it owns one)."""
        closer = getattr(self.settings.open_env, "aclose", None)
        if closer is not None:
            await closer()
