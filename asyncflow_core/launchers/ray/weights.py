"""Weights from the trainer actor to the rollout actors without passing through the driver.

``launcher.options.weights`` picks the path of every published version:

- ``driver``: the trainer actor returns every bucket to the driver, the run's
  configured weight transport stages them there, and each replica's proxy
  ``ray.put`` s them (once per version, shared by the replicas). The driver
  holds a whole copy of the model; kept as the baseline.
- ``object_store``: the trainer actor ``ray.put`` s each bucket itself and
  returns one light :class:`WeightHandle` per bucket (layout, checksum, the
  object's reference, no buffer). The handles travel through
  :class:`HandleTransport` in the driver; each replica's actor fetches the
  buckets from the object store and its engine verifies their checksums.
- ``dist``: the trainer actor (rank 0) and every live rollout actor form a
  torch.distributed group on 127.0.0.1 (gloo on CPU, NCCL when both roles
  have GPUs: single node only) run by the ``dist`` weight transport plugin
  inside the actors: announce before receive, chunked broadcasts, checksums
  verified on arrival. The driver only orders "trainer: send version v"
  (:meth:`RayWeights.export`) and "replica i: load version >= v"
  (:meth:`RayWeights.load`); the handles it stages carry no reference.

A gloo group cannot take a new member, so the group is re-formed (a new
generation on a new port) before the first send after the set of live
rollout actors changed. A rank that dies during a broadcast would hold the
trainer's rank until the send's deadline, so the driver probes the group's
actors while a send runs and abandons it on a death, then re-forms the group
and sends once more. A replica that missed a version by being outside the
group (restarted after it was sent, or the group was re-formed before it
loaded it) catches up over the object store: the trainer actor puts the
version it holds and the replica fetches it.

This module is the driver's side (:class:`RayWeights`); the actors' side is
:mod:`.weight_actors`, the handles both sides pass :mod:`.handles`, the
watched actors :mod:`.watch`. It imports Ray only where it asks the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from typing import Any, Protocol

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import KVCachePolicy
from asyncflow_core.launchers.ray.handles import DEFAULT_MODE, HandleTransport, WeightHandle, WeightsMode
from asyncflow_core.launchers.ray.watch import WatchedActor

log = logging.getLogger("asyncflow.ray")

#: how long a health probe of the rollout actors waits (a dead actor answers at once; a busy one is kept), and how
#: often the actors of the group are probed while a broadcast runs
LIVENESS_PROBE_S = 1.0


class WatchedReplica(Protocol):
    """A rollout replica as the weight path sees it: a proxy holding its watched actor (``RemoteRolloutEngine``)."""

    watched: WatchedActor


@dataclasses.dataclass
class _Group:
    """The dist group as the driver knows it: its generation and the rollout actors in it, by rank."""

    generation: int
    port: int
    members: dict[str, int]  #: rollout actor id -> rank
    stale: bool = False  #: a send failed on it: re-form before the next


class RayWeights:
    """One run's weight path under the ray launcher (see the module docstring); lives in the driver."""

    def __init__(self, mode: WeightsMode, *, deadline_s: float, backend: str = "gloo", chunk_mb: float = 16.0,
                 join_timeout_s: float | None = None, counters: Counter[str] | None = None) -> None:
        if mode not in ("object_store", "dist", "driver"):
            raise WeightTransferError(f"launcher.options.weights={mode!r}: pick object_store, dist or driver")
        self.mode: WeightsMode = mode
        self.deadline_s = deadline_s
        self.backend = backend
        self.chunk_mb = chunk_mb
        self.join_timeout_s = deadline_s if join_timeout_s is None else join_timeout_s  #: a rank not in by then fails
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.transport: HandleTransport | None = None
        self.replicas: list[WatchedReplica] = []
        self.trainer: WatchedActor | None = None
        self.group: _Group | None = None
        self._lock = asyncio.Lock()

    def make_transport(self) -> HandleTransport:
        """The run's weight transport (``object_store`` / ``dist``): the handles pass through it unchanged."""
        self.transport = HandleTransport(self.mode, on_close=self.close)
        return self.transport

    def add_replica(self, proxy: WatchedReplica) -> None:
        self.replicas.append(proxy)

    # -- sending --------------------------------------------------------------------------

    async def export(self, trainer: WatchedActor, bucket_bytes: int) -> list[WeightHandle]:
        """Have the trainer actor publish its current version; the handles to stage (no bytes come here)."""
        self.trainer = trainer
        if self.mode == "object_store":
            return await trainer.call("put_weights", bucket_bytes, timeout=self.deadline_s)
        end = time.monotonic() + self.deadline_s
        async with self._lock:
            for attempt in (1, 2):
                await self._form_group(trainer)
                left = end - time.monotonic()
                try:
                    return await self._send_watched(trainer, bucket_bytes, left)
                except WeightTransferError as exc:
                    assert self.group is not None
                    self.group.stale = True  # a failed broadcast may have broken the group: never reuse it
                    if attempt == 2 or end - time.monotonic() < 1.0:
                        raise
                    self.counters["weight_group_retries"] += 1
                    log.warning("weight broadcast failed (%s); re-forming the group and sending again", exc)
        raise AssertionError("unreachable")

    async def _send_watched(self, trainer: WatchedActor, bucket_bytes: int, left: float) -> list[WeightHandle]:
        """``send_weights`` on the trainer, abandoned as soon as a rank of the group is found dead.

        A dead receiver would otherwise hold the send until its deadline (the
        source waits for every rank to take part); abandoning it lets the
        driver form the group again without that rank and send once more.
        """
        send = asyncio.ensure_future(trainer.call("send_weights", bucket_bytes, left, timeout=left + 30.0))
        watch = asyncio.ensure_future(self._first_dead_member())
        try:
            done, _ = await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
            if send not in done:
                reason = watch.result()
                self.counters["weight_sends_abandoned"] += 1
                await _quiet(trainer.call("abandon_weight_send", reason, timeout=30.0))
                return await send
            try:
                return send.result()
            except WeightTransferError:
                # the transport saw the dead rank first (gloo: "connection reset") and failed the send itself,
                # before the liveness poll found it: the same fast failure, counted apart
                self.counters["weight_sends_failed"] += 1
                raise
        finally:
            watch.cancel()

    async def _first_dead_member(self) -> str:
        """Returns (never raises) once a rollout actor of the current group is gone: lost, replaced or dead."""
        g = self.group
        assert g is not None
        while True:
            await asyncio.sleep(LIVENESS_PROBE_S)  # a liveness poll of remote processes: nothing to wait on instead
            for r in self.replicas:
                if r.watched.lost is not None and r.watched.actor is not None \
                        and _actor_id(r.watched.actor) in g.members:
                    return f"{r.watched.role} was lost ({r.watched.lost.reason})"
            here = {_actor_id(r.watched.actor): r for r in self.replicas if r.watched.actor is not None}
            gone = [aid for aid in g.members if aid not in here]
            if gone:
                return f"rank {g.members[gone[0]]}'s rollout actor was replaced"
            members = [here[aid] for aid in g.members]
            alive = await asyncio.gather(*(_probe(r.watched.actor) for r in members))
            dead = [r.watched.role for r, ok in zip(members, alive, strict=True) if not ok]
            if dead:
                return f"{dead[0]}'s actor died"

    async def _live_replicas(self) -> list[WatchedReplica]:
        """Replicas whose actor is up: a killed actor answers a health probe with an error at once."""
        candidates = [r for r in self.replicas if r.watched.lost is None and r.watched.actor is not None]
        probes = {asyncio.ensure_future(_probe(r.watched.actor)): r for r in candidates}
        if not probes:
            return []
        done, _ = await asyncio.wait(list(probes), timeout=LIVENESS_PROBE_S)
        dead = {probes[f] for f in done if f.result() is False}
        for f in probes:
            if f not in done:
                f.add_done_callback(lambda fut: fut.exception())
        return [r for r in candidates if r not in dead]

    async def _form_group(self, trainer: WatchedActor) -> None:
        """Re-form the group when the live rollout actors changed (or a send failed on it); else keep it."""
        failure: BaseException | None = None
        for _ in range(3):
            live = await self._live_replicas()
            ids = [_actor_id(r.watched.actor) for r in live]
            g = self.group
            if g is not None and not g.stale and set(ids) == set(g.members):
                return
            if g is None:
                _check_single_node()
            else:  # receivers first: their listeners stop before the trainer's store goes away
                await asyncio.gather(*(_quiet(r.watched.call("close_weight_group", timeout=30.0))
                                       for r in live if _actor_id(r.watched.actor) in g.members))
            generation = 1 if g is None else g.generation + 1
            world = len(live) + 1
            port = await trainer.call("open_weight_group", generation, world, self.backend, self.join_timeout_s,
                                      self.chunk_mb, timeout=60.0)
            opened = await asyncio.gather(*(r.watched.call("open_weight_group", port, world, rank, self.backend,
                                                           self.join_timeout_s, self.chunk_mb, timeout=60.0)
                                            for rank, r in enumerate(live, start=1)), return_exceptions=True)
            # a replica lost while joining: the group cannot complete without it; form it again without it
            failed = [o for o in opened if isinstance(o, BaseException)]
            stale = bool(failed)
            failure = failed[0] if failed else None
            self.group = _Group(generation, port, {aid: rank for rank, aid in enumerate(ids, start=1)}, stale=stale)
            if g is not None:
                self.counters["weight_group_reformed"] += 1
            log.info("weight group generation %d on 127.0.0.1:%d: trainer + %d rollout actors (%s)", generation,
                     port, len(live), self.backend)
            if not stale:
                return
        raise WeightTransferError(f"the dist weight group could not be formed: rollout actors kept failing to join "
                                  f"(last: {type(failure).__name__}: {failure})")

    # -- loading --------------------------------------------------------------------------

    async def load(self, replica: WatchedReplica, version: int, handles: list[WeightHandle],
                   kv_cache: KVCachePolicy) -> int:
        """Load ``handles``' version (or a newer one) into ``replica``'s engine; returns the engine's version."""
        w = replica.watched
        if handles[0].ref is None:
            g = self.group
            if g is not None and handles[0].generation == g.generation and _actor_id(w.actor) in g.members:
                try:
                    return int(await w.call("load_weights_dist", version, self.deadline_s, kv_cache,
                                            timeout=self.deadline_s + 30.0))
                except WeightTransferError as exc:  # e.g. the group was re-formed under this load: the bytes are gone
                    log.warning("%s: version %d from the weight group: %s; catching up over the object store",
                                w.role, version, exc)
            # outside the group that carried this version (restarted since, or the group was re-formed)
            if self.trainer is None:
                raise WeightTransferError("no trainer has published weights yet")
            self.counters["weight_catch_ups_object_store"] += 1
            handles = await self.trainer.call("put_last_weights", version, timeout=self.deadline_s)
            version = handles[0].version
        refs = [h.ref for h in handles]
        return int(await w.call("update_weights_refs", version, refs, kv_cache, [h.checksum for h in handles],
                                timeout=self.deadline_s))

    async def close(self) -> None:
        """Close the dist group's ranks (their actors end with the run anyway)."""
        g, self.group = self.group, None
        if g is None:
            return
        calls = [r.watched.call("close_weight_group", timeout=10.0) for r in self.replicas
                 if r.watched.lost is None and _actor_id(r.watched.actor) in g.members]
        if self.trainer is not None and self.trainer.lost is None:
            calls.append(self.trainer.call("close_weight_group", timeout=10.0))
        await asyncio.gather(*(_quiet(c) for c in calls))


def _check_single_node() -> None:
    """The dist group meets on 127.0.0.1: refuse, with the fix, a cluster whose actors could be on other nodes."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        raise WeightTransferError(
            f"launcher.options.weights=dist forms its group on 127.0.0.1, so it works on one node; this Ray cluster "
            f"has {len(nodes)} nodes: set launcher.options.weights=object_store"
        )


def _actor_id(actor: Any) -> str:
    return actor._actor_id.hex()


async def _probe(actor: Any) -> bool:
    """False when the actor is gone (its call fails); True when it answered."""
    import ray

    try:
        await actor.health.remote()
    except ray.exceptions.RayActorError:
        return False
    except Exception:  # noqa: BLE001 - the engine's health() raised: the actor is alive
        return True
    return True


async def _quiet(call: Any) -> None:
    with contextlib.suppress(Exception):
        await call


__all__ = ["DEFAULT_MODE", "HandleTransport", "RayWeights", "WatchedReplica", "WeightHandle", "WeightsMode"]
