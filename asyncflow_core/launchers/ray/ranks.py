"""A train engine's ranks as Ray actors: one actor per rank, torch.distributed initialised inside them.

:class:`RayRankGroup` has the interface of the process
:class:`~asyncflow_core.launchers.ranks.RankGroup` (``call``, ``alive``,
``pids``, ``broken``, ``stop`` and the same :class:`RankError` messages), so
the ``fsdp`` and ``megatron`` engines drive it unchanged. Each
:class:`RankActor` runs the engine's unchanged rank loop ``target(rank,
world_size, conn, *args)`` on a thread of its own, with ``conn`` one end of
an in-process pipe; the actor's ``call`` writes the command bytes into the
pipe and returns the rank's reply. The ranks' ``op_setup`` therefore runs
inside the actors: gloo on CPU, NCCL on GPU (one GPU per rank actor).

Ray places the actors (bundles of the trainer's placement group, see
:class:`RayRankSpawner`) and sees them; an actor's death resolves its pending
call with an error at once, which becomes a :class:`RankError` naming the
rank, and the whole group is then killed, as with rank processes.

One node only: the ranks rendezvous as they do as processes, rank 0 binding
``127.0.0.1``. A group whose actors land on several nodes is refused with a
:class:`~asyncflow_core.errors.ConfigError` before any rank binds anything;
spanning nodes needs rank 0 to bind (and gloo/NCCL to use) an address the
other nodes can reach, and weight export by something other than this
host's shared memory. docs/launchers.md ("Trainer ranks as actors").
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncflow_core.errors import ConfigError
from asyncflow_core.launchers.ranks import RankError, RankHandle, RankSpawner

_NO_PAYLOAD = object()
_SHUTDOWN = pickle.dumps(("shutdown", None))


class RankActor:
    """One rank: ``target(rank, world_size, conn, *args)`` on a thread, fed through an in-process pipe.

    Two calls may run at once (``max_concurrency=2``) so that ``ping`` answers
    while a command runs; commands themselves go through the pipe one at a
    time.
    """

    def __init__(self, rank: int, world_size: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.rank = rank
        self._conn, child = Pipe(duplex=True)
        self._lock = threading.Lock()
        self._ended = ""  # why the rank loop returned, once it has
        self._thread = threading.Thread(target=self._serve, args=(target, rank, world_size, child, args),
                                        name=f"asyncflow-rank{rank}", daemon=True)
        self._thread.start()

    def _serve(self, target: Callable[..., None], rank: int, world_size: int, child: Any,
               args: tuple[Any, ...]) -> None:
        try:
            target(rank, world_size, child, *args)
            self._ended = "its rank loop returned"
        except BaseException as exc:  # noqa: BLE001 - reported to the driver by the next call
            self._ended = f"its rank loop raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            child.close()  # the next read of this actor's end sees EOF instead of waiting forever

    def where(self) -> dict[str, Any]:
        """This rank's process and node (the group checks that every rank shares one node)."""
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "placement_group": ctx.get_placement_group_id()}

    def call(self, command: bytes) -> tuple[str, Any]:
        """Hand one pickled ``(op, payload)`` to the rank and return its decoded reply.

        ``("gone", why)`` when the rank loop has ended (its thread returned or
        raised), so the driver reports it as a dead rank.
        """
        with self._lock:
            try:
                self._conn.send_bytes(command)
                # the reply of the rank loop on this process's own thread, through a pipe no other process holds
                return pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._thread.join(timeout=1.0)
                return "gone", self._ended or "its rank loop ended"

    def ping(self) -> bool:
        """Whether the rank loop still runs."""
        return self._thread.is_alive()


_RemoteRank = ray.remote(RankActor)


class RayRankGroup:
    """``world_size`` :class:`RankActor` s running ``target``; the ``ray`` counterpart of the process ``RankGroup``.

    Every actor is owned by the process that made the group (Ray ends owned
    actors with their owner) and placed in ``bundle_indices[rank]`` of
    ``placement_group`` when one is given. Raises :class:`RankError` when an
    actor cannot start (or be placed) within ``start_timeout_s``, and
    :class:`ConfigError` when the actors landed on more than one node.
    """

    def __init__(self, world_size: int, target: Callable[..., None], args: tuple[Any, ...], *,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, placement_group: Any = None,
                 bundle_indices: Sequence[int] = (), start_timeout_s: float = 300.0,
                 name: str = "asyncflow-rank") -> None:
        if placement_group is not None and len(bundle_indices) != world_size:
            raise ConfigError(f"{name}: {world_size} rank actors need {world_size} placement bundles, "
                              f"got {len(bundle_indices)}")
        self.world_size = world_size
        self.name = name
        self.broken: str | None = None
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._where: list[dict[str, Any]] = []
        # one command at a time, even if a caller gave up waiting (a cancelled task's thread runs on)
        self._lock = threading.Lock()
        try:
            for rank in range(world_size):
                opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0,
                                        "max_concurrency": 2}
                if placement_group is not None:
                    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group=placement_group, placement_group_bundle_index=bundle_indices[rank])
                self._actors.append(_RemoteRank.options(**opts).remote(rank, world_size, target, args))
            self._where = self._gather_where(start_timeout_s)
        except BaseException:
            self.stop(grace_s=0)
            raise
        self._pids = [w["pid"] for w in self._where]

    def _gather_where(self, timeout_s: float) -> list[dict[str, Any]]:
        refs = [a.where.remote() for a in self._actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(done) < len(refs):
            late = [r for r, ref in enumerate(refs) if ref not in done]
            raise RankError(f"{self.name}: rank actor(s) {late} did not start within {timeout_s:g} s (not placed: "
                            "the placement group or cluster lacks their CPUs/GPUs, or a slow start); lower "
                            "launcher.options.trainer_rank_cpus / trainer_rank_gpus or add resources",
                            rank=late[0])
        where = []
        for rank, ref in enumerate(refs):
            try:
                where.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                raise RankError(f"{self.name}: rank {rank} could not start: {_first_line(exc)}", rank=rank) from None
        check_one_node(self.name, where)
        return where

    @property
    def pids(self) -> list[int]:
        return list(self._pids) if self._actors else []

    @property
    def node_ips(self) -> list[str]:
        """The node address of each rank's actor."""
        return [w["ip"] for w in self._where] if self._actors else []

    def alive(self) -> list[bool]:
        """Whether each rank's actor (and its rank loop) still runs; one that does not answer in 2 s counts as alive."""
        refs = [a.ping.remote() for a in self._actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0) if refs else ([], [])
        out = []
        for ref in refs:
            if ref not in done:
                out.append(True)  # busy or stopped, not known to be gone (as a SIGSTOPped process is alive)
                continue
            try:
                out.append(bool(ray.get(ref)))
            except ray.exceptions.RayError:
                out.append(False)
        return out

    def call(self, op: str, payloads: Sequence[Any] | Any = _NO_PAYLOAD, *, timeout_s: float,
             what: str | None = None, same: Any = _NO_PAYLOAD) -> list[Any]:
        """Send ``op`` to every rank (``payloads[r]`` to rank r, or ``same`` to all) and return every rank's result.

        Raises :class:`RankError` (and kills every rank actor) when a rank
        raises, its actor dies, or not every rank answers within ``timeout_s``.
        """
        what = what or op
        if self.broken is not None:
            raise RankError(f"{what}: the engine's ranks were shut down after an earlier failure ({self.broken}); "
                            "create a new engine (or load a checkpoint into one)")
        if same is not _NO_PAYLOAD:
            shared = ray.put(pickle.dumps((op, same)))  # one copy in the object store, read by every rank
            commands: list[Any] = [shared] * self.world_size
        else:
            if payloads is _NO_PAYLOAD:
                payloads = [None] * self.world_size
            if len(payloads) != self.world_size:
                raise ValueError(f"{what}: {len(payloads)} payloads for {self.world_size} ranks")
            commands = [pickle.dumps((op, p)) for p in payloads]
        with self._lock:
            if self.broken is not None:
                raise RankError(f"{what}: the engine's ranks were shut down ({self.broken})")
            refs = {a.call.remote(cmd): rank for rank, (a, cmd) in enumerate(zip(self._actors, commands,
                                                                                    strict=True))}
            return self._collect(refs, what, timeout_s)

    def _collect(self, refs: dict[Any, int], what: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results: list[Any] = [None] * self.world_size
        pending = dict(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(pending.values())
                raise self._fail(
                    f"{what}: rank(s) {late} did not answer within {timeout_s:g} s (raise the engine's timeout_s "
                    "if the work is legitimately that long); the ranks were shut down", rank=late[0])
            # the first reply, error or death of any rank ends the wait: a failed rank is reported at once
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    status, value = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise self._fail(self._death_message(what, rank, f"its Ray actor died ({_first_line(exc)})"),
                                     rank=rank) from None
                except ray.exceptions.RayError as exc:
                    raise self._fail(self._death_message(what, rank, f"its call failed ({_first_line(exc)})"),
                                     rank=rank) from None
                if status == "gone":
                    reason, _, tb = str(value).partition("\n")
                    raise self._fail(self._death_message(what, rank, reason), rank=rank, tb=tb)
                if status == "error":
                    kind, message, tb = value
                    raise self._fail(f"{what}: rank {rank} raised {kind}: {message}", rank=rank, tb=tb)
                results[rank] = value
        return results

    def _death_message(self, what: str, rank: int, reason: str) -> str:
        pid = self._pids[rank] if rank < len(self._pids) else None
        return f"{what}: rank {rank} (pid {pid}) died: {reason}; the other ranks were shut down"

    def _fail(self, message: str, *, rank: int | None, tb: str = "") -> RankError:
        self.broken = message
        self.stop(grace_s=0)
        return RankError(message, rank=rank, remote_traceback=tb)

    def stop(self, *, grace_s: float = 10.0) -> None:
        """Ask every rank to exit (up to ``grace_s``), then kill every rank actor and wait for Ray to see them gone.

        Safe to repeat, and after Ray itself has shut down.
        """
        if self.broken is None:
            self.broken = "shut down"
        actors, self._actors = self._actors, []
        if not actors or not ray.is_initialized():
            return
        try:
            if grace_s > 0:
                asked = [a.call.remote(_SHUTDOWN) for a in actors]
                ray.wait(asked, num_returns=len(asked), timeout=grace_s)
            for a in actors:
                ray.kill(a, no_restart=True)
            # a killed actor's pending calls fail once Ray has ended its process: wait for that, briefly
            gone = [a.ping.remote() for a in actors]
            ray.wait(gone, num_returns=len(gone), timeout=10.0)
        except Exception:  # noqa: BLE001, S110 - Ray is going away (interpreter exit); its actors go with it
            pass


@dataclass(frozen=True)
class RayRankSpawner(RankSpawner):
    """Start rank groups as :class:`RayRankGroup` s: one actor per rank with these resources, in these bundles.

    ``bundle_indices`` (one per rank, of ``placement_group``) come from the
    ``ray`` launcher's trainer pool; without a placement group Ray schedules
    the actors where the resources are. ``start_method`` and ``preload`` of
    :meth:`start` are for rank processes and have no meaning here: each actor
    is a fresh Ray worker.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    placement_group: Any = None
    bundle_indices: tuple[int, ...] = ()
    start_timeout_s: float = 300.0

    def start(self, world_size: int, target: Callable[..., None], args: tuple[Any, ...], *, start_method: str,
              preload: Sequence[str] = (), name: str = "asyncflow-rank") -> RankHandle:
        if self.placement_group is not None and len(self.bundle_indices) != world_size:
            raise ConfigError(
                f"{name}: the engine wants {world_size} ranks, the ray launcher reserved {len(self.bundle_indices)} "
                "rank bundles; the trainer's world_size must match what the launcher read from its options")
        return RayRankGroup(world_size, target, args, num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                            placement_group=self.placement_group, bundle_indices=self.bundle_indices,
                            start_timeout_s=self.start_timeout_s, name=name)

    def gpus_for_ranks(self, world_size: int) -> int:
        """One GPU per rank actor when ranks get GPUs (``num_gpus`` >= 1), else none: the engine picks CPU (gloo)."""
        return world_size if self.num_gpus >= 1 else 0


def check_one_node(name: str, where: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`ConfigError` unless every rank (``where[rank]``: its ``node_id`` and ``ip``) shares one node.

    The ranks rendezvous on 127.0.0.1 (rank 0 binds it) and hand exported
    weights over in this host's shared memory; binding a routable address
    instead is a decision this code does not take silently.
    """
    nodes = {w["node_id"] for w in where}
    if len(nodes) > 1:
        spread = [(r, w["ip"]) for r, w in enumerate(where)]
        raise ConfigError(
            f"{name}: the {len(where)} rank actors were placed on {len(nodes)} nodes ((rank, node ip): {spread}); "
            "a rank group rendezvous on 127.0.0.1 and exports weights through its host's shared memory, so it must "
            "sit on one node. Give one node room for every rank (launcher.options.placement separate or colocated "
            "packs the trainer's bundles; check that node's CPUs/GPUs) or set launcher.options.trainer_ranks: "
            "processes. Ranks spanning nodes are not supported yet (docs/launchers.md, 'Trainer ranks as actors')")


def trainer_rank_actors(trainer_ranks: str, trainer_options: Any) -> int:
    """How many rank actors a trainer built from ``trainer_options`` gets under ``trainer_ranks``; 0: none.

    Engines without a ``world_size`` option, a world size of 1, and
    ``trainer_ranks: processes`` keep their ranks (if any) inside the trainer actor.
    """
    world_size = getattr(trainer_options, "world_size", 1)
    if trainer_ranks != "actors" or not isinstance(world_size, int) or world_size <= 1:
        return 0
    return world_size


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(exc: BaseException) -> str:
    """Ray's error in one line: its headline (without actor ids) and, when there is one, the underlying error.

    A failed actor creation, for example, reads "The actor died because of an
    error raised in its creation task, ray::RankActor.__init__() ...
    ModuleNotFoundError: No module named 'x'".
    """
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines()]
    lines = [line for line in lines if line and set(line) != {"^"}]
    if not lines:
        return type(exc).__name__
    first, last = lines[0].split(" (pid=")[0], lines[-1]
    text = first if len(lines) == 1 else f"{first} ... {last}"
    return text if len(text) <= 400 else text[:397] + "..."


__all__ = ["RankActor", "RayRankGroup", "RayRankSpawner", "check_one_node", "trainer_rank_actors"]
