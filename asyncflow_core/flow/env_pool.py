"""Where environments run: one per episode, under a per-call time limit, in the event loop or in worker processes.

:class:`EnvironmentPool` opens one environment per episode from the plugin's
factory and hands back a :class:`PooledEnvironment`: the same
``reset``/``step``/``close``/``tools``/``features`` as an
:class:`~asyncflow_core.interfaces.Environment`, plus the seconds spent in
each call. Every call runs under ``step_timeout_s``; every exception, time-out
or broken worker becomes :class:`~asyncflow_core.errors.EnvironmentFailure`
with a one-line reason naming the call and the turn, and ``close`` always
runs (``async with pool.episode() as env``).

``processes=0`` runs environments in the event loop (``asyncio.wait_for``):
right for environments whose steps await. ``processes=N`` keeps each
environment object in one of N worker processes (spawned) and proxies the
calls over a pipe, so a tool that blocks or holds the GIL never stalls
decoding in the rollout process. There each environment runs on a thread of
its own (with its own event loop), so a blocking step holds only its own
episode: a process serves as many blocking waits at once as it has episodes
(``workers / processes``), and CPU-bound tools run ``processes`` at once
(one GIL each). Episodes go to the least loaded process. A call that times
out there cannot be interrupted, so its worker is terminated and restarted:
the other episodes living in that worker fail too, each with a reason that
says so (recorded, never lost). Their environments report why in
``PooledEnvironment.lost`` (the one whose call timed out does not), so a
multi-turn episode rebuilds or restarts them (flow/episode_recovery.py).
``workers`` bounds the episodes open at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from asyncflow_core.errors import EnvironmentFailure
from asyncflow_core.interfaces.environment import (
    Action,
    Environment,
    EnvironmentFactory,
    EnvironmentFeatures,
    Observation,
    Step,
    ToolSpec,
)
from asyncflow_core.flow.env_workers import (  # noqa: F401 - re-exported: callers import them from here
    DEFAULT_BLOCKING_PROCESSES,
    WORKER_START_TIMEOUT_S,
    CallTiming,
    _one_line,
    _where,
    PluginEnvironmentFactory,
    _build,
    _check_observation,
    _check_step,
    _Worker,
)


class PooledEnvironment(Environment):
    """One episode's environment as the pool runs it; raises only :class:`EnvironmentFailure`.

    ``timings`` lists every call with its seconds, measured where the call
    runs: from the call's first instruction to its answer (in a worker
    process, by the worker, without the pipe; in the event loop, without the
    wait to be scheduled); ``seconds`` is their sum (the episode's
    environment time).
    """

    def __init__(self, pool: EnvironmentPool, features: EnvironmentFeatures, tools: Sequence[ToolSpec],
                 *, env: Environment | None = None, worker: _Worker | None = None, env_id: int = 0) -> None:
        self._pool = pool
        self._features = features
        self._tools = tuple(tools)
        self._env = env
        self._worker = worker
        self._env_id = env_id
        self.timings: list[CallTiming] = []
        self.closed = False
        self._timed_out = False  #: a call of this environment timed out, and its worker was restarted for it

    @property
    def lost(self) -> str | None:
        """Why this environment object is gone through no call of its own: its worker process exited, or was
        restarted after another episode's call timed out (the episode may rebuild it: ``features.restore``).
        None while it lives, for in-loop environments, after its own call timed out, and once the pool is closed."""
        if self._worker is None or self._timed_out or self._pool._closed:
            return None
        return self._worker.dead

    @property
    def features(self) -> EnvironmentFeatures:
        return self._features

    @property
    def tools(self) -> Sequence[ToolSpec]:
        return self._tools

    @property
    def seconds(self) -> float:
        """Environment seconds of this episode so far (all calls)."""
        return sum(t.seconds for t in self.timings)

    async def reset(self, record: Mapping[str, Any], *, seed: int) -> Observation:
        return await self._call("reset", None, (record, seed))

    async def step(self, action: Action) -> Step:
        return await self._call("step", action.turn, action)

    async def close(self) -> None:
        """Close the environment (once; later calls do nothing) and free its slot, even when closing fails."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._call("close", None, None)
        finally:
            if self._worker is not None:
                self._worker.episodes -= 1
            self._pool._release()

    async def _call(self, call: str, turn: int | None, payload: Any) -> Any:
        if self.closed and call != "close":
            raise EnvironmentFailure(f"environment {_where(call, turn)} after close", call=call, turn=turn)
        start = time.perf_counter()
        measured: list[float] = []  # the call's own seconds (no pipe, no wait to be scheduled in this loop)
        try:
            if self._worker is None:
                return await self._in_loop(call, turn, payload, measured)
            return await self._in_worker(call, turn, payload, measured)
        finally:
            self.timings.append(CallTiming(call, turn, measured[0] if measured else time.perf_counter() - start))

    async def _in_loop(self, call: str, turn: int | None, payload: Any, measured: list[float]) -> Any:
        assert self._env is not None
        env = self._env

        async def timed() -> Any:  # timed from its first run: the task's wait to be scheduled is not the call's
            start = time.perf_counter()
            try:
                if call == "reset":
                    return await env.reset(payload[0], seed=payload[1])
                if call == "step":
                    return await env.step(payload)
                return await env.close()
            finally:
                measured.append(time.perf_counter() - start)

        timeout = self._pool.step_timeout_s
        try:
            value = await asyncio.wait_for(timed(), timeout)
            if call == "step":
                return _check_step(value)
            return _check_observation(value, "reset") if call == "reset" else value
        except asyncio.TimeoutError:
            raise EnvironmentFailure(f"environment {_where(call, turn)} timed out after {timeout:g}s "
                                     "(environment.step_timeout_s)", call=call, turn=turn) from None
        except EnvironmentFailure as exc:
            raise EnvironmentFailure(f"environment {_where(call, turn)} failed: {exc.reason}",
                                     call=call, turn=turn) from None
        except Exception as exc:  # noqa: BLE001 - the episode fails with a reason; the run goes on
            raise EnvironmentFailure(f"environment {_where(call, turn)} failed: {_one_line(exc)}",
                                     call=call, turn=turn) from None

    async def _in_worker(self, call: str, turn: int | None, payload: Any,
                         measured: list[float] | None = None) -> Any:
        assert self._worker is not None
        worker = self._worker
        if call == "close" and worker.dead is not None:
            return None  # the process is gone, and with it what the environment held
        timeout = self._pool.step_timeout_s
        try:
            ok, value = await asyncio.wait_for(worker.request(call, self._env_id, payload, measured), timeout)
        except asyncio.TimeoutError:
            why = (f"worker process {worker.index} was restarted after a {_where(call, turn)} of another episode "
                   f"timed out after {timeout:g}s")
            self._timed_out = True
            self._pool._retire(worker, why)
            raise EnvironmentFailure(f"environment {_where(call, turn)} timed out after {timeout:g}s "
                                     "(environment.step_timeout_s); its worker process was restarted",
                                     call=call, turn=turn) from None
        if not ok:
            raise EnvironmentFailure(f"environment {_where(call, turn)} failed: {value}", call=call, turn=turn)
        return value


class EnvironmentPool:
    """Opens one environment per episode and runs its calls (see the module docstring).

    ``factory`` builds one environment per call. With ``processes > 0`` it is
    pickled into each worker process: pass a :class:`PluginEnvironmentFactory`
    (what :meth:`from_plugin` does) or another picklable callable.
    """

    def __init__(self, factory: EnvironmentFactory, *, step_timeout_s: float = 30.0, workers: int = 64,
                 processes: int = 0, mp_context: str = "spawn") -> None:
        if step_timeout_s <= 0 or workers < 1 or processes < 0:
            raise ValueError("EnvironmentPool needs step_timeout_s > 0, workers >= 1 and processes >= 0")
        self.factory = factory
        self.step_timeout_s = step_timeout_s
        self.workers = workers
        self.processes = processes
        self._context = multiprocessing.get_context(mp_context)
        self._slots = asyncio.Semaphore(workers)
        self._procs: list[_Worker | None] = [None] * processes
        self._started = itertools.count()
        self._env_ids = itertools.count()
        self._closed = False
        self._open = 0

    @classmethod
    def from_plugin(cls, name: str, options: Mapping[str, Any] | None = None, *, step_timeout_s: float = 30.0,
                    workers: int = 64, processes: int | None = None) -> EnvironmentPool:
        """A pool for a registered environment; ``processes=None``: 0, or a few when it declares blocking."""
        factory = PluginEnvironmentFactory(name, options)
        if processes is None:
            processes = DEFAULT_BLOCKING_PROCESSES if factory.features.blocking else 0
        return cls(factory, step_timeout_s=step_timeout_s, workers=workers, processes=processes)

    @classmethod
    def from_config(cls, config: Any) -> EnvironmentPool:
        """A pool from a run config's ``environment`` section (:class:`~asyncflow_core.config.EnvironmentConfig`)."""
        return cls.from_plugin(config.name, config.options, step_timeout_s=config.step_timeout_s,
                               workers=config.workers or 64, processes=config.processes)

    @property
    def in_flight(self) -> int:
        """Episodes open now (at most ``workers``)."""
        return self._open

    def _release(self) -> None:
        self._open -= 1
        self._slots.release()

    async def open(self) -> PooledEnvironment:
        """Wait for a free slot (``workers``), build an environment; ``EnvironmentFailure`` if that fails.

        The caller must ``close()`` what it gets; :meth:`episode` does it for you.
        """
        if self._closed:
            raise EnvironmentFailure("the environment pool is closed", call="open")
        await self._slots.acquire()
        self._open += 1
        start = time.perf_counter()
        try:
            env = await (self._open_in_worker() if self.processes else self._open_in_loop())
        except BaseException:
            self._release()
            raise
        env.timings.append(CallTiming("open", None, time.perf_counter() - start))
        return env

    async def _open_in_loop(self) -> PooledEnvironment:
        try:
            env = await asyncio.wait_for(_build(self.factory), self.step_timeout_s)
            features, tools = env.features, tuple(env.tools)
        except asyncio.TimeoutError:
            raise EnvironmentFailure(f"environment open timed out after {self.step_timeout_s:g}s", call="open") \
                from None
        except Exception as exc:  # noqa: BLE001
            raise EnvironmentFailure(f"environment open failed: {_one_line(exc)}", call="open") from None
        return PooledEnvironment(self, features, tools, env=env)

    async def _open_in_worker(self) -> PooledEnvironment:
        worker = self._place()
        env_id = next(self._env_ids)
        worker.episodes += 1
        pooled = PooledEnvironment(self, EnvironmentFeatures(), (), worker=worker, env_id=env_id)
        try:
            try:  # a cold start (interpreter, imports) is not the environment's time
                await asyncio.wait_for(asyncio.shield(worker.ready), WORKER_START_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._retire(worker, "its worker process did not start")
                raise EnvironmentFailure(f"environment open failed: worker process {worker.index} did not start "
                                         f"within {WORKER_START_TIMEOUT_S:g}s", call="open") from None
            features, tools = await pooled._in_worker("open", None, None)
        except BaseException:
            worker.episodes -= 1
            raise
        pooled._features, pooled._tools = features, tuple(tools)
        return pooled

    def _place(self) -> _Worker:
        """The least loaded live worker, starting (or restarting) processes as needed."""
        for i, w in enumerate(self._procs):
            if w is None or w.dead is not None:
                self._procs[i] = _Worker(next(self._started), self.factory, self._context)
        live = [w for w in self._procs if w is not None]
        return min(live, key=lambda w: w.episodes)

    def _retire(self, worker: _Worker, why: str) -> None:
        worker.kill(why)  # its slot in _procs is refilled by the next _place()

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[PooledEnvironment]:
        """``async with pool.episode() as env:`` one environment, closed on the way out whatever happens.

        A failure to close is raised as :class:`EnvironmentFailure` only when
        the episode itself did not fail (the first failure is the reason).
        """
        env = await self.open()
        try:
            yield env
        except BaseException:
            with contextlib.suppress(EnvironmentFailure):
                await env.close()
            raise
        await env.close()

    async def close(self) -> None:
        """Stop the worker processes (environments still open there are dropped with their process)."""
        self._closed = True
        for w in self._procs:
            if w is not None:
                await w.stop()
        self._procs = [None] * self.processes

    async def __aenter__(self) -> EnvironmentPool:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
