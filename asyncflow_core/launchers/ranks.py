"""A train engine's rank group: ``world_size`` ranks serving the engine's commands, and where they run.

A train engine (``fsdp``, ``megatron``) drives its ranks through one small
interface, :class:`RankHandle`: send a command to every rank, gather every
answer with one deadline, tear the whole group down on any failure. Each
rank runs the engine's unchanged loop ``target(rank, world_size, conn,
*args)``, reading pickled ``(op, payload)`` commands from ``conn`` and writing
pickled ``("ok", value)`` / ``("error", (kind, message, traceback))`` replies.

*Where* the ranks run is the process's :class:`RankSpawner`. By default
:class:`RankGroup` starts them as child processes of the engine's process
(a duplex pipe each, watched with the process sentinels). A launcher that
places ranks itself installs another spawner before the engine is built
(:func:`install_rank_spawner`, :func:`use_rank_spawner`); the ``ray``
launcher's puts each rank in its own Ray actor
(:mod:`asyncflow_core.launchers.ray.ranks`). Engines call
:func:`start_rank_group` and never need to know which.

Rank processes (the default):

Each rank gets a duplex pipe. A command goes to every rank; the driver then
waits on the pipes *and* the process sentinels with one deadline, so a rank
that dies or stops answering becomes an :class:`RankError` with the reason
instead of a hang. After any failure the group is torn down: the surviving
ranks may be blocked inside a collective that can never complete.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import connection
from typing import Any, Protocol, runtime_checkable

from asyncflow_core.errors import EngineError

_NO_PAYLOAD = object()


class RankError(EngineError):
    """A rank failed, died or timed out. ``rank`` says which; ``remote_traceback`` holds the rank's traceback."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RankGroup:
    """``world_size`` processes running ``target(rank, world_size, conn, *args)``: the default rank group.

    Each process is named ``f"{name}{rank}"``.
    """

    def __init__(self, world_size: int, target: Callable[..., None], args: tuple[Any, ...], *,
                 start_method: str, preload: Sequence[str] = (), name: str = "asyncflow-rank") -> None:
        import torch.multiprocessing as mp  # here, not at the top: a rank actor imports this module without torch

        self.world_size = world_size
        ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            # only takes effect if this process has not started its forkserver yet
            ctx.set_forkserver_preload(list(preload))
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self.broken: str | None = None
        # one command at a time on the pipes, even if a caller gave up waiting (a cancelled task's thread runs on)
        self._lock = threading.Lock()
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=target, args=(rank, world_size, child, *args),
                                   name=f"{name}{rank}", daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        except BaseException:
            self.stop(grace_s=0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def call(self, op: str, payloads: Sequence[Any] | Any = _NO_PAYLOAD, *, timeout_s: float,
             what: str | None = None, same: Any = _NO_PAYLOAD) -> list[Any]:
        """Send ``op`` to every rank (``payloads[r]`` to rank r, or ``same`` to all) and return every rank's result.

        Raises :class:`RankError` (and tears the group down) when a rank
        raises, dies, or does not answer within ``timeout_s``.
        """
        what = what or op
        if self.broken is not None:
            raise RankError(f"{what}: the engine's ranks were shut down after an earlier failure ({self.broken}); "
                            "create a new engine (or load a checkpoint into one)")
        if same is not _NO_PAYLOAD:
            payloads = [same] * self.world_size
        elif payloads is _NO_PAYLOAD:
            payloads = [None] * self.world_size
        assert len(payloads) == self.world_size
        with self._lock:
            if self.broken is not None:
                raise RankError(f"{what}: the engine's ranks were shut down ({self.broken})")
            rank = 0
            try:
                for rank, conn in enumerate(self._conns):
                    conn.send_bytes(pickle.dumps((op, payloads[rank])))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                # the pipe of `rank` broke: that rank is gone (or going)
                raise self._fail(self._death_message(what, rank), rank=rank) from None
            return self._collect(what, timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(pending)
                raise self._fail(
                    f"{what}: rank(s) {late} did not answer within {timeout_s:g} s (raise the engine's timeout_s "
                    "if the work is legitimately that long); the ranks were shut down", rank=late[0])
            waitables = [self._conns[r] for r in sorted(pending)] + list(sentinels)
            for ready in connection.wait(waitables, timeout=remaining):
                if isinstance(ready, int):  # a process sentinel: that rank is gone
                    rank = sentinels[ready]
                    if rank in pending and self._conns[rank].poll(0):
                        continue  # it answered before dying: read the answer first
                    raise self._fail(self._death_message(what, rank), rank=rank)
                rank = by_conn[id(ready)]
                try:
                    status, value = pickle.loads(ready.recv_bytes())
                except (EOFError, OSError):
                    raise self._fail(self._death_message(what, rank), rank=rank) from None
                pending.discard(rank)
                if status == "error":
                    kind, message, tb = value
                    raise self._fail(f"{what}: rank {rank} raised {kind}: {message}", rank=rank, tb=tb)
                results[rank] = value
        return results

    def _death_message(self, what: str, rank: int | None = None) -> str:
        if rank is None:
            deadline = time.monotonic() + 1.0  # a killed process may take a moment to be reapable
            dead: list[int] = []
            while not dead and time.monotonic() < deadline:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if not dead:
                    time.sleep(0.02)
            rank = dead[0] if dead else 0
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return (f"{what}: rank {rank} (pid {proc.pid}) died: {_exit_reason(proc.exitcode)}; "
                "the other ranks were shut down")

    def _fail(self, message: str, *, rank: int | None, tb: str = "") -> RankError:
        self.broken = message
        self.stop(grace_s=0)
        return RankError(message, rank=rank, remote_traceback=tb)

    def stop(self, *, grace_s: float = 10.0) -> None:
        """Ask every live rank to exit, then terminate and kill what is left; always reaps. Safe to repeat."""
        if self.broken is None:
            self.broken = "shut down"
        if grace_s > 0:
            for conn, proc in zip(self._conns, self._procs, strict=False):
                if proc.is_alive():
                    try:
                        conn.send_bytes(pickle.dumps(("shutdown", None)))
                    except (BrokenPipeError, ConnectionResetError, OSError):
                        pass
            deadline = time.monotonic() + grace_s
            live = [p.sentinel for p in self._procs if p.is_alive()]
            while live and time.monotonic() < deadline:
                connection.wait(live, timeout=max(0.0, deadline - time.monotonic()))
                live = [p.sentinel for p in self._procs if p.is_alive()]
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)  # also ends a stopped (SIGSTOP) process
                except ProcessLookupError:
                    pass
                proc.join(timeout=5.0)
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.close()
            except ValueError:
                pass  # still running after SIGKILL: nothing more we can do from here
        self._conns, self._procs = [], []


# ====================================================================== where ranks run


@runtime_checkable
class RankHandle(Protocol):
    """What an engine holds for its started ranks (:class:`RankGroup`, or a spawner's own group)."""

    world_size: int
    #: why the group no longer takes commands (a failure, or "shut down"); None while it is usable
    broken: str | None

    @property
    def pids(self) -> list[int]:
        """Process id of each rank, in rank order."""
        ...

    def alive(self) -> list[bool]:
        """Whether each rank is still running."""
        ...

    def call(self, op: str, payloads: Sequence[Any] | Any = ..., *, timeout_s: float, what: str | None = None,
             same: Any = ...) -> list[Any]:
        """Send ``op`` to every rank and return every rank's result (raises :class:`RankError`, tearing down)."""
        ...

    def stop(self, *, grace_s: float = 10.0) -> None:
        """Ask every rank to exit, then end what is left; safe to repeat."""
        ...


class RankSpawner:
    """Decides where a train engine's ranks run; the base class starts them as child processes (:class:`RankGroup`).

    Subclass it to run ranks elsewhere (the ``ray`` launcher's
    :class:`~asyncflow_core.launchers.ray.ranks.RayRankSpawner` puts each in a
    Ray actor) and install it with :func:`install_rank_spawner` before the
    engine's ``setup()``.
    """

    def start(self, world_size: int, target: Callable[..., None], args: tuple[Any, ...], *, start_method: str,
              preload: Sequence[str] = (), name: str = "asyncflow-rank") -> RankHandle:
        """Start ``world_size`` ranks each running ``target(rank, world_size, conn, *args)``; return their handle.

        ``start_method`` and ``preload`` are how to start rank *processes*
        (a spawner that does not fork may ignore them); ``name`` labels the ranks.
        """
        return RankGroup(world_size, target, args, start_method=start_method, preload=preload, name=name)

    def gpus_for_ranks(self, world_size: int) -> int:
        """How many GPUs the ranks, together, will be able to use: decides an engine's ``device: auto``.

        Child processes see what this process sees.
        """
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0


_DEFAULT_SPAWNER = RankSpawner()
_installed: RankSpawner | None = None
_installed_lock = threading.Lock()


def install_rank_spawner(spawner: RankSpawner | None) -> RankSpawner | None:
    """Make ``spawner`` start every rank group this process starts from now on (None: child processes again).

    Process-wide on purpose: an engine starts its ranks from a worker thread
    (``asyncio.to_thread``) and, under the ``ray`` launcher, inside an actor
    that hosts only that engine. Returns the spawner it replaced.
    """
    global _installed
    with _installed_lock:
        previous, _installed = _installed, spawner
    return previous


@contextlib.contextmanager
def use_rank_spawner(spawner: RankSpawner) -> Iterator[RankSpawner]:
    """Install ``spawner`` for the ``with`` block, then put back what was installed before."""
    previous = install_rank_spawner(spawner)
    try:
        yield spawner
    finally:
        install_rank_spawner(previous)


def rank_spawner() -> RankSpawner:
    """The spawner this process starts rank groups with: the installed one, else child processes."""
    installed = _installed
    return installed if installed is not None else _DEFAULT_SPAWNER


def start_rank_group(world_size: int, target: Callable[..., None], args: tuple[Any, ...], *, start_method: str,
                     preload: Sequence[str] = (), name: str = "asyncflow-rank") -> RankHandle:
    """Start a train engine's ranks with this process's spawner (:func:`rank_spawner`); see ``RankSpawner.start``."""
    return rank_spawner().start(world_size, target, args, start_method=start_method, preload=preload, name=name)


def rank_cpu_threads(world_size: int, others: int = 0, explicit: int | None = None) -> int:
    """Intra-op threads of one CPU rank: ``explicit``, or this host's cores shared by the ``world_size`` ranks and
    ``others`` more busy processes (at least 1)."""
    return explicit or max(1, (os.cpu_count() or 1) // (world_size + others))


def driver_cpu_threads(world_size: int, per_rank: int) -> int:
    """Intra-op threads left to the process that started ``world_size`` CPU ranks of ``per_rank`` threads each on
    this host (at least 1): what a rollout engine computing in that process should use beside them."""
    return max(1, (os.cpu_count() or 1) - world_size * per_rank)


def gpus_for_ranks(world_size: int) -> int:
    """GPUs a rank group started now could use together (:meth:`RankSpawner.gpus_for_ranks` of :func:`rank_spawner`)."""
    return rank_spawner().gpus_for_ranks(world_size)


__all__ = ["RankError", "RankGroup", "RankHandle", "RankSpawner", "driver_cpu_threads", "gpus_for_ranks",
           "install_rank_spawner", "rank_cpu_threads",
           "rank_spawner", "start_rank_group", "use_rank_spawner"]
