"""The parts of the environment pool below its interface: the plugin factory that crosses into worker
processes, the checks of what an environment returns, the one-line failure texts, and the worker processes
themselves (environments by id behind a pipe). :mod:`asyncflow_core.flow.env_pool` uses them.

In a worker process every environment lives on a thread of its own, with its own event loop: its calls run
there one after another (as in the rollout process's loop), and a call that blocks (``time.sleep``, blocking
I/O, a C extension) holds only its own episode. So one process serves as many blocking waits at once as it
has episodes open; CPU-bound Python tools still share the process's GIL, so those run ``processes`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncflow_core.interfaces.environment import (
    Environment,
    EnvironmentFactory,
    EnvironmentFeatures,
    Observation,
    Step,
)

#: worker processes used by default for an environment that declares ``features.blocking``
DEFAULT_BLOCKING_PROCESSES = 2
#: seconds a new worker process may take to start (interpreter, imports); not counted against a step
WORKER_START_TIMEOUT_S = 120.0
_READY = -1  #: request id of the message a worker sends once it is up


@dataclass(frozen=True)
class CallTiming:
    """Seconds one environment call took, measured where it ran: in the event loop from its first run (not the
    wait to be scheduled); in a worker process by the worker (no pipe, no wait for the rollout process's loop);
    the wait as the rollout process saw it when no answer came (a lost worker)."""

    call: str  #: open, reset, step or close
    turn: int | None  #: the step's turn; None for the other calls
    seconds: float


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _where(call: str, turn: int | None) -> str:
    return f"{call} (turn {turn})" if turn is not None else call


class PluginEnvironmentFactory:
    """A registered environment's factory with its options bound, by plugin name: picklable, so workers rebuild it.

    Each call builds one environment (``record.factory(validated options)``).
    """

    def __init__(self, name: str, options: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.options = dict(options or {})
        self._bound: tuple[Any, Any] | None = None
        self._module: str | None = None  #: set in a worker process: the module to register if the name is unknown

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "options": self.options, "module": self._plugin_module()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], state["options"])  # type: ignore[misc]
        self._module = state.get("module")

    def _plugin_module(self) -> str | None:
        """The module that registered this environment, when it is one (a module registered by hand, e.g.
        ``get_plugin_manager().register_module(...)`` in a test or a script): a worker process that does not
        find the environment among its built-ins and entry points registers that module too."""
        if self._module is not None:
            return self._module
        try:
            from asyncflow_core.plugins import PluginKind, get_plugin_manager

            plugin = get_plugin_manager().lookup(PluginKind.ENVIRONMENT, self.name).plugin
        except Exception:  # noqa: BLE001 - opening the first episode reports an unknown environment
            return None
        return plugin if plugin in sys.modules else None

    def _record_and_options(self) -> tuple[Any, Any]:
        if self._bound is None:
            from asyncflow_core.errors import UnknownPluginError
            from asyncflow_core.plugins import PluginKind, get_plugin_manager

            pm = get_plugin_manager()
            try:
                record = pm.lookup(PluginKind.ENVIRONMENT, self.name).record
            except UnknownPluginError:
                if self._module is None:
                    raise
                pm.register_module(self._module, distribution="unknown")  # registered by hand in the parent
                record = pm.lookup(PluginKind.ENVIRONMENT, self.name).record
            self._bound = (record, pm.validate_options(PluginKind.ENVIRONMENT, self.name, self.options))
        return self._bound

    @property
    def features(self) -> EnvironmentFeatures:
        """What an environment built with these options declares (options may turn ``blocking`` on).

        Builds one environment without resetting it (environments acquire per-episode resources in
        ``reset``); a factory that is async, or fails, leaves the registration's declaration.
        """
        record, options = self._record_and_options()
        try:
            env = record.factory(options)
        except Exception:  # noqa: BLE001 - opening the first episode reports it with a reason
            env = None
        declared = getattr(env, "features", None) if isinstance(env, Environment) else None
        if inspect.iscoroutine(env):
            env.close()
        return declared if isinstance(declared, EnvironmentFeatures) else record.features

    def prepare(self) -> None:
        """Look the plugin up and validate its options now (a worker process does it once, at start)."""
        self._record_and_options()

    def __call__(self) -> Any:
        record, options = self._record_and_options()
        return record.factory(options)


async def _build(factory: EnvironmentFactory) -> Environment:
    env = factory()
    if inspect.isawaitable(env):
        env = await env
    if not isinstance(env, Environment):
        raise TypeError(f"the environment factory returned {type(env).__name__}, not an Environment")
    return env


def _check_observation(value: Any, call: str) -> Observation:
    if not isinstance(value, Observation):
        raise TypeError(f"{call} returned {type(value).__name__}, not an Observation")
    return value


def _check_step(value: Any) -> Step:
    if not isinstance(value, Step):
        raise TypeError(f"step returned {type(value).__name__}, not a Step")
    return value


# -- worker processes ---------------------------------------------------------------------------------------


class _EnvThread:
    """One environment's thread in a worker process, running an event loop of its own (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def call(self, fn: Any) -> Any:
        """Await ``fn()`` on this thread's loop (``fn`` itself is called there too); the caller's loop waits
        without being held."""
        async def run() -> Any:
            return await fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))

    def stop(self) -> None:
        """End the loop (after the call running there, if any, returns); the thread then exits."""
        with contextlib.suppress(RuntimeError):  # already stopped
            self.loop.call_soon_threadsafe(self.loop.stop)


def _worker_main(conn: Any, factory: EnvironmentFactory) -> None:
    """A worker process: environments by id, each on its own thread and event loop (see the module docstring).

    The process's main loop reads requests (a reader thread hands them over), hands each call to its
    environment's thread and sends the answer back; ``open`` starts the thread, ``close`` ends it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    envs: dict[int, tuple[Environment, _EnvThread]] = {}
    tasks: set[asyncio.Task[None]] = set()  # strong references until each call is answered
    send_lock = threading.Lock()
    prepare = getattr(factory, "prepare", None)
    if callable(prepare):  # bind the plugin once, before environment threads race to do it
        with contextlib.suppress(Exception):  # opening the first episode reports the reason
            prepare()

    def reply(req: int, ok: bool, value: Any, seconds: float = 0.0) -> None:
        with send_lock:
            try:
                conn.send((req, ok, value, seconds))
            except Exception as exc:  # noqa: BLE001 - an unpicklable result is reported, not lost
                conn.send((req, False, f"the result could not be sent back from the worker: {_one_line(exc)}",
                           seconds))

    async def opened(env_id: int) -> Any:
        runner = _EnvThread(f"env-{env_id}")
        try:
            env = await runner.call(lambda: _build(factory))
        except BaseException:
            runner.stop()
            raise
        envs[env_id] = (env, runner)
        return env.features, tuple(env.tools)

    async def closed(env_id: int) -> Any:
        env, runner = envs.pop(env_id, (None, None))
        if env is None or runner is None:
            return None
        try:
            return await runner.call(env.close)
        finally:
            runner.stop()

    async def handle(req: int, op: str, env_id: int, payload: Any) -> None:
        start = time.perf_counter()  # the call's own seconds, sent back with its answer
        try:
            if op == "open":
                value: Any = await opened(env_id)
            elif op == "reset":
                env, runner = envs[env_id]
                record, seed = payload
                value = _check_observation(await runner.call(lambda: env.reset(record, seed=seed)), "reset")
            elif op == "step":
                env, runner = envs[env_id]
                value = _check_step(await runner.call(lambda: env.step(payload)))
            elif op == "close":
                value = await closed(env_id)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # noqa: BLE001 - every failure goes back as a reason
            reply(req, False, _one_line(exc), time.perf_counter() - start)
        else:
            reply(req, True, value, time.perf_counter() - start)

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None:  # the parent's shutdown request, or its end of the pipe closed
                loop.call_soon_threadsafe(loop.stop)
                return
            loop.call_soon_threadsafe(start, msg)

    def start(msg: tuple[Any, ...]) -> None:
        task = loop.create_task(handle(*msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    threading.Thread(target=read, name="env-worker-reader", daemon=True).start()
    reply(_READY, True, None)
    loop.run_forever()


class _Worker:
    """One worker process as the rollout process sees it: pending requests and the episodes living there."""

    def __init__(self, index: int, factory: EnvironmentFactory, context: Any) -> None:
        self.index = index
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, factory), daemon=True,
                                       name=f"asyncflow-env-worker-{index}")
        self.process.start()
        child.close()
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.episodes = 0  #: environments placed here and not closed yet
        self.dead: str | None = None  #: why this worker is gone
        self.ready: asyncio.Future[None] = self.loop.create_future()  #: resolved once the process is up
        self.seconds: dict[int, float] = {}  #: request id -> the seconds the worker measured for it (until taken)
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name=f"env-worker-{index}-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                req, ok, value, seconds = self.conn.recv()
            except (EOFError, OSError):
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    self.loop.call_soon_threadsafe(self._lost, "its worker process exited")
                return
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._resolve, req, ok, value, seconds)

    def _resolve(self, req: int, ok: bool, value: Any, seconds: float = 0.0) -> None:
        if req == _READY:
            if not self.ready.done():
                self.ready.set_result(None)
            return
        fut = self.pending.pop(req, None)
        if fut is not None and not fut.done():
            self.seconds[req] = seconds
            fut.set_result((ok, value))

    def _lost(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
        if not self.ready.done():
            self.ready.set_result(None)  # waiters then see ``dead``
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result((False, self.dead))
        self.pending.clear()

    async def request(self, op: str, env_id: int, payload: Any = None,
                      timing: list[float] | None = None) -> tuple[bool, Any]:
        """Send one call and wait for its answer; ``timing`` gets the seconds the worker measured, when it did."""
        if self.dead is not None:
            return False, self.dead
        req = next(self._ids)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self.pending[req] = fut
        try:
            self.conn.send((req, op, env_id, payload))
        except Exception as exc:  # noqa: BLE001 - an unpicklable record or action, or a closed pipe
            self.pending.pop(req, None)
            return False, f"the request could not be sent to the worker: {_one_line(exc)}"
        try:
            return await fut
        finally:
            seconds = self.seconds.pop(req, None)
            if seconds is not None and timing is not None:
                timing.append(seconds)

    def _reap(self, grace: float) -> None:
        """Wait ``grace`` seconds for the process to exit, then end it; touches only the process and pipe."""
        self.process.join(grace)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self._reader.join(5)  # returns once the pipe reports EOF; only then is closing it safe
        self.conn.close()

    def kill(self, why: str) -> None:
        """Terminate the process now; pending and later requests fail with ``why`` (event-loop thread)."""
        self._lost(why)
        self._reap(0)

    async def stop(self) -> None:
        """Ask the worker to exit, wait for it off the loop, and terminate it if it does not."""
        if self.dead is None:
            self._lost("the environment pool was closed")
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
        await asyncio.to_thread(self._reap, 5)


# -- the pool -------------------------------------------------------------------------------------------------
