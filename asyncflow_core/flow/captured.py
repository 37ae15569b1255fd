"""Captured episodes: a black-box agent, written against the OpenAI SDK, run once per prompt row.

The run's ``agent`` section names a coroutine ``agent(record, *, base_url,
api_key, **options)``. Per row, :class:`Captured` opens a session on the
run's :class:`~asyncflow_core.capture.CaptureServer` and runs the agent as a
task of its own, pointed at the session's ``base_url``. Each chat (or
completion) call the agent makes becomes the episode's next *turn request*
in the rollout stage's own dispatch: the session's ``sample`` hands the
call's prompt tokens to the episode and waits; the stage dispatches the
episode like a multi-turn one (replica slots, abort and resume after a
prefix, re-queue on a replica's death, the staleness bound over every
sampled token), and the finished turn goes back to the waiting call. While
the agent thinks or runs its tools the episode holds no replica slot, so a
slow agent never blocks dispatch.

When the agent returns, the session's :class:`~asyncflow_core.types.episode.Trajectory`
is written (the capture endpoint's loss mask: 1 on sampled tokens, 0 on the
rendered prompt, tool results and template glue). Its reward is the one the
agent posted on the session's reward route, else the run's reward plugin
scores the episode. An agent that raises, or takes longer than
``agent.timeout_s`` between two calls, fails its row with that reason; a
call past ``agent.max_calls`` is refused and ends the episode there (written,
``truncated``). An episode whose earlier calls fall out of the staleness
bound starts the agent again on a new session (or is dropped under
``stale_policy: drop``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from asyncflow_core import columns as C
from asyncflow_core.capture import CaptureError, CaptureServer, CaptureSession
from asyncflow_core.flow.env_values import record_for_env
from asyncflow_core.flow.multi_turn import MultiTurn, Progress
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, RewardInput, SamplingParams
from asyncflow_core.types.episode import Trajectory

log = logging.getLogger("asyncflow.flow")

__all__ = ["AgentEpisodes", "AgentSettings", "Captured", "plugin_scorer"]

#: scores a finished episode that the agent left unscored: (trajectory, the row's record) -> reward
Scorer = Callable[[Trajectory, Any], Awaitable[float]]


@dataclass
class AgentSettings:
    """What every captured episode of a run shares."""

    agent: Callable[..., Awaitable[Any]]
    server: CaptureServer
    entry: str = "agent"  #: the ``package.module:function`` it was imported from (for the recorded reasons)
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = 120.0  #: longest the agent may run between two calls (and before its first / after
    #: its last); None: no limit
    max_calls: int = 8
    score: Scorer | None = None  #: the reward plugin, for episodes the agent did not score itself

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {self.max_calls}")


@dataclass
class _Call:
    """One agent call waiting for its turn: the tokens to sample after, the call's sampling, its answer."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    answer: asyncio.Future


def _line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(eq=False)  # the stage keeps a set of the episodes with an open session
class Captured(SingleTurn):
    """One agent run: its calls are the turn requests, the session's :class:`Trajectory` the row."""

    multi_turn: ClassVar[bool] = True

    settings: AgentSettings | None = None
    factory: AgentEpisodes | None = None
    record: Any = None  #: the dataset row (a PromptRecord or a mapping) the agent is given
    prompt_stored: tuple[int, ...] = ()
    session: CaptureSession | None = None
    task: asyncio.Task | None = None  #: the agent
    failure: str | None = None
    cut: str | None = None  #: why it ended before the agent returned (``max_calls``)
    restarts: int = 0
    _calls: asyncio.Queue | None = None  #: calls the agent made, in order (None: the max_calls refusal)
    _call: _Call | None = None  #: the call being sampled
    _taken: int = 0  #: calls answered
    _asked: int = 0  #: calls made
    _oldest: int | None = None
    _finish: FinishReason | None = None
    _agent_s: float = 0.0
    _traj: Trajectory | None = None

    # -- requests: the same staleness accounting as a multi-turn episode ---------------------------

    held_versions = MultiTurn.held_versions
    oldest_version = MultiTurn.oldest_version
    oldest_with = MultiTurn.oldest_with

    def retry_turn(self) -> None:
        """Sample the current call again; the episode's start (``origin_version``) stays."""
        origin = self.origin_version
        super().retry_turn()
        self.origin_version = origin

    @property
    def turn(self) -> int:
        """Calls answered so far."""
        return self._taken

    @property
    def request_id(self) -> str:
        return f"row{self.row}-try{self.attempt}-call{self._taken}"

    def request(self, sampling: SamplingParams) -> GenerationRequest:
        call = self._call
        assert call is not None, "a captured episode is dispatched only with an agent call waiting"
        return GenerationRequest(
            request_id=self.request_id, prompt_token_ids=call.prompt, sampling=call.sampling,
            prefix_token_ids=self.prefix_ids, prefix_logprobs=self.prefix_lps, prefix_versions=self.prefix_versions,
        )

    # -- the session's sample function ---------------------------------------------------------------

    async def _sample(self, prompt: list[int], sampling: SamplingParams) -> GenerationResult:
        s = self.settings
        assert s is not None and self._calls is not None
        if self._asked >= s.max_calls:
            self.cut = "max_calls"
            self._calls.put_nowait(None)
            raise CaptureError(400, f"this episode already made its {s.max_calls} calls (agent.max_calls); "
                               "the episode ends here", code="max_calls")
        self._asked += 1
        answer = asyncio.get_running_loop().create_future()
        self._calls.put_nowait(_Call(tuple(int(t) for t in prompt), sampling, answer))
        return await answer

    # -- the episode's life ------------------------------------------------------------------------

    async def begin(self) -> Progress:
        """Open a session and start the agent on it; wait for its first call."""
        s, f = self.settings, self.factory
        assert s is not None and f is not None
        try:
            await f.start()
        except Exception as exc:  # noqa: BLE001 - e.g. aiohttp missing: the row's recorded reason
            self.failure = f"the capture endpoint could not start: {_line(exc)}"
            return Progress.FAILED
        rec = record_for_env(self.record)
        f.live.add(self)
        self._calls = asyncio.Queue()
        self.session = s.server.open_session(metadata={"row": self.row, "index": rec.get("index")},
                                             sample=self._sample)
        session = self.session
        self.task = asyncio.ensure_future(
            s.agent(rec, base_url=session.base_url, api_key=session.api_key, **dict(s.options)))
        return await self._next()

    def take_turn(self, res: GenerationResult) -> None:
        """The waiting call's tokens (stop or length), exactly as the engine returned them, go back to the agent."""
        call, self._call = self._call, None
        assert call is not None
        lo = res.min_version
        if lo is not None:
            self._oldest = lo if self._oldest is None else min(self._oldest, lo)
        self._finish = res.finish_reason
        self._taken += 1
        self.prefix_ids, self.prefix_lps, self.prefix_versions = (), (), ()
        if not call.answer.done():
            call.answer.set_result(res)

    async def advance(self) -> Progress:
        """Wait for the agent's next call, or its end."""
        return await self._next()

    async def _next(self) -> Progress:
        s = self.settings
        assert s is not None and self._calls is not None and self.task is not None
        get = asyncio.ensure_future(self._calls.get())
        t0 = time.perf_counter()
        try:
            done, _ = await asyncio.wait({get, self.task}, timeout=s.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._agent_s += time.perf_counter() - t0
            if not get.done():
                get.cancel()
        if get in done:
            call = get.result()
            if call is None:  # the call past max_calls was refused: the episode ends there
                await self._stop_agent()
                return await self._collect()
            self._call = call
            return Progress.CONTINUE
        if self.task in done:
            exc = None if self.task.cancelled() else self.task.exception()
            if self.task.cancelled():
                return self._fail(f"the agent {s.entry} was cancelled")
            if exc is not None:
                return self._fail(f"the agent {s.entry} raised {_line(exc)}")
            return await self._collect()
        return self._fail(f"the agent {s.entry} made no call and did not return within {s.timeout_s:g}s "
                          "(agent.timeout_s)")

    def _fail(self, why: str) -> Progress:
        self.failure = why
        return Progress.FAILED

    async def _collect(self) -> Progress:
        """Close the session; its trajectory, scored by the agent's posted reward or the reward plugin."""
        s, f = self.settings, self.factory
        assert s is not None and f is not None and self.session is not None
        self._refuse_waiting("the episode ended")
        session, self.session = self.session, None
        traj = await s.server.close_session(session)
        if traj.status != "ok":
            return self._fail(traj.status.removeprefix("failed: "))
        reward = traj.reward
        if reward is None:
            if s.score is None:
                return self._fail("the agent posted no reward and the run has no reward plugin to score it")
            try:
                reward = await s.score(traj, self.record)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failing reward fails that row
                return self._fail(f"reward: {_line(exc)}")
        info = traj.info
        parsed, bad = int(info.get("tool_calls", 0)), int(info.get("tool_call_parse_errors", 0))
        info.update(tool_calls=parsed + bad, tool_ok=parsed, env_s=self._agent_s, restarts=self.restarts,
                    truncated=self.cut is not None or (info.get("finish_reasons") or ["stop"])[-1] == "length")
        if self.cut:
            info["cut"] = self.cut
        traj.reward = float(reward)
        self._traj = traj
        self.prompt = traj.prompt_ids
        return Progress.DONE

    def trajectory(self) -> Trajectory:
        assert self._traj is not None, "trajectory() is read once the episode is DONE"
        return self._traj

    def _refuse_waiting(self, why: str) -> None:
        """Answer every call still waiting (its handler ends; the session's lock is released)."""
        calls = [self._call] if self._call is not None else []
        self._call = None
        while self._calls is not None and not self._calls.empty():
            calls.append(self._calls.get_nowait())
        for call in calls:
            if call is not None and not call.answer.done():
                call.answer.set_exception(CaptureError(410, f"{why}; this call gets no answer", code="episode_ended"))

    async def _stop_agent(self) -> None:
        task, self.task = self.task, None
        if task is None or task.done():
            if task is not None and not task.cancelled():
                task.exception()  # retrieved: a failure after the episode ended is not logged as unretrieved
            return
        task.cancel()
        self._refuse_waiting("the episode was stopped")
        await asyncio.wait({task}, timeout=10.0)  # never raises: the caller's own cancellation still propagates
        if not task.done():
            log.warning("episode of row %d: the agent ignored its cancellation for 10s", self.row)
        elif not task.cancelled():
            task.exception()  # retrieved: the agent's reaction to its cancellation is not logged as unretrieved

    async def close(self) -> None:
        """Stop the agent and forget its session (errors are logged, never raised; closing twice is harmless)."""
        try:
            self._refuse_waiting("the episode was closed")
            session, self.session = self.session, None
            if session is not None and self.settings is not None:
                self.settings.server.sessions.pop(session.id, None)  # later calls get 404
                session.closed = True
            await self._stop_agent()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("episode of row %d: closing the agent failed: %s", self.row, _line(exc))
        if self.factory is not None:  # only once the agent is stopped: the factory's close stops it otherwise
            self.factory.live.discard(self)

    def restart(self) -> None:
        """Run the agent again from the start on a new session (call :meth:`close` first), as a new request."""
        self.retry_turn()
        self.restarts += 1
        self.failure = self.cut = None
        self._calls = self._call = self._traj = None
        self._taken = self._asked = 0
        self._oldest, self._finish, self._agent_s = None, None, 0.0
        self.origin_version = None  # a new session: its age counts from its new first call
        self.prompt = self.prompt_stored


class AgentEpisodes:
    """The episode factory for the ``agent`` section: one :class:`Captured` per prompt row.

    The capture server starts with the first episode and stops in :meth:`close` (the run's end).
    """

    multi_turn = True
    columns: tuple[str, ...] = ROLLOUT_OUT + C.EPISODE_COLUMNS + (C.REWARD,)

    def __init__(self, settings: AgentSettings, *, on_close: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.settings = settings
        self._on_close = on_close
        self._lock = asyncio.Lock()
        self._closed = False
        self.live: set[Captured] = set()  #: episodes with an agent running (stopped before the server)

    async def start(self) -> None:
        """Start the capture server (once)."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("the run's episodes are closed")
            await self.settings.server.start()

    def new(self, row: int, lease: Any, prompt: tuple[int, ...], group: int, ctx: Any) -> Captured:
        info = ctx.ledger.groups.get(group) if ctx is not None else None
        return Captured(row, lease, prompt, group, settings=self.settings, factory=self,
                        record=info.record if info is not None else None, prompt_stored=prompt)

    async def close(self) -> None:
        """Stop the agents still running, the capture server, and the reward scorer's pool when it owns one."""
        for ep in list(self.live):  # no call may be left waiting on the server's handlers
            await ep.close()
        async with self._lock:
            self._closed = True
            await self.settings.server.stop()
        if self._on_close is not None:
            await self._on_close()


def plugin_scorer(reward: Any, decode: Callable[[Sequence[int]], str], *, timeout_s: float) -> Scorer:
    """Score an episode with the run's reward plugin, as the reward stage scores a completion: the record's
    prompt and metadata, the response (every token after the prompt, decoded once) as the completion."""
    many = bool(getattr(getattr(reward, "features", None), "supports_score_many", False))

    async def score(traj: Trajectory, record: Any) -> float:
        response = traj.response_ids
        sample = RewardInput(
            prompt=getattr(record, "prompt", "") if record is not None else "", completion=decode(response),
            prompt_token_ids=tuple(traj.prompt_ids), completion_token_ids=tuple(response),
            metadata=dict(getattr(record, "metadata", {}) or {}) if record is not None else {},
        )
        if many:  # a remote reward pool: (ok, value or why) per sample
            [(ok, value)] = await reward.score_many([sample], timeout_s)
            if not ok:
                raise RuntimeError(str(value))
        else:
            value = reward.score(sample)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
        if isinstance(value, Mapping):
            if "reward" not in value:
                raise ValueError(f"the reward returned a mapping without a 'reward' key (keys: {sorted(value)})")
            value = value["reward"]
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"the reward returned {value!r}, not a finite number")
        return number

    return score
