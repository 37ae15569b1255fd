"""Driver-side proxies: each implements a role's interface by calling its actor, and watches that actor.

Every call races the actor's reply against the actor's death and a
deadline, so nothing waits forever on a dead or hung actor:

- the actor process dies (``ray.kill``, OOM, a crash): the pending call fails
  at once with :class:`RoleLost` (Ray reports the dead actor);
- the actor stops answering: a heartbeat (``health()`` every
  ``heartbeat_s``) that gets no reply within ``heartbeat_timeout_s``
  declares it dead, kills it, and fails every pending call with the reason;
- one call runs past its own deadline (a weight update past
  ``weight_transport.deadline_s``): :class:`RoleTimeout`, and the actor is
  killed, because its state is then unknown.

Both errors are :class:`~asyncflow_core.errors.EngineError`: the rollout
stage treats them like any engine failure (the replica is marked dead, its
requests are re-queued) and then asks the proxy to :meth:`restart`. The
watching itself (:class:`WatchedActor`, the errors) is :mod:`.watch`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from asyncflow_core.errors import EngineError, UnsupportedFeatureError, WeightTransferError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine, TrainEngine
from asyncflow_core.interfaces.features import RewardFeatures
from asyncflow_core.launchers.ray.handles import WeightHandle
from asyncflow_core.launchers.ray.watch import RoleLost, RoleTimeout, WatchedActor, short_reason
from asyncflow_core.types import GenerationRequest, GenerationResult, RewardInput, WeightBucket

if TYPE_CHECKING:
    from asyncflow_core.launchers.ray.weights import RayWeights

log = logging.getLogger("asyncflow.ray")

#: a generate poll returns after this long with whatever finished (empty is fine); bounded so death shows quickly
POLL_S = 1.0


class _Description:
    """An actor's features, version and pid, asked for at creation and read when first needed.

    Asking without waiting lets every actor of a run boot at once (each
    imports torch, seconds apiece); only the first reader waits.
    """

    def __init__(self, watched: WatchedActor) -> None:
        self.watched = watched
        self._ref = watched.actor.describe.remote()
        self._value: dict[str, Any] | None = None
        self._version: int | None = None

    def get(self) -> dict[str, Any]:
        if self._value is None:
            try:
                self._value = ray.get(self._ref, timeout=self.watched.heartbeat_timeout_s * 5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                raise RoleLost(self.watched.role, f"it did not start ({short_reason(exc)})") from None
        return self._value

    async def fetch(self) -> dict[str, Any]:
        if self._value is None:
            self._value = await self.watched.call("describe", timeout=self.watched.heartbeat_timeout_s * 5)
        return self._value

    @property
    def version(self) -> int:
        return int(self.get()["version"]) if self._version is None else self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = int(value)


# ------------------------------------------------------------------------------------------ rollout


class _ActorProxy:
    """What every proxy shares: its actor, and ending it (the role shut down inside it first, once)."""

    watched: WatchedActor
    _shut: bool
    #: how long the role's own shutdown may take inside the actor before the actor is ended anyway
    shutdown_timeout_s: float = 30.0

    @property
    def actor(self) -> Any:
        return self.watched.actor

    async def shutdown(self) -> None:
        """Shut the role down inside its actor, then end the actor. Safe to call twice."""
        if self.watched.lost is None and not self._shut:
            self._shut = True
            try:
                await self.watched.call("shutdown", timeout=self.shutdown_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the actor goes anyway
                log.warning("%s: shutdown: %s", self.watched.role, exc)
        self.watched.kill()


class _RestartableProxy(_ActorProxy):
    """A proxy whose actor may be replaced: why it was lost, replacing it within ``max_restarts``, its health.

    A subclass sets ``watched``, ``max_restarts``, ``restarts``, ``counters``,
    ``restart_counter`` and ``_shut``, and may refresh what it caches of the
    old actor in :meth:`_after_spawn`.
    """

    max_restarts: int
    restarts: int
    counters: Counter[str]
    restart_counter: str

    @property
    def lost(self) -> RoleLost | None:
        """Why its actor was declared lost (death, heartbeat), or None while it is taken to be alive."""
        return self.watched.lost

    async def _replace(self) -> None:
        if self.restarts >= self.max_restarts:
            raise EngineError(f"{self.watched.role}: no restarts left (launcher.options.max_restarts="
                              f"{self.max_restarts})")
        self.restarts += 1
        self.counters[self.restart_counter] += 1
        self.watched.kill()
        self.watched.spawn()
        self._after_spawn()

    def _after_spawn(self) -> None:
        """Forget what was cached of the replaced actor (nothing by default)."""

    async def health(self) -> Any:
        return await self.watched.call("health", timeout=self.watched.heartbeat_timeout_s)


class RemoteRolloutEngine(_RestartableProxy, RolloutEngine):
    """A :class:`RolloutEngine` whose engine lives in a Ray actor (see :class:`~.actors.RolloutActor`).

    Weights arrive as :class:`~.handles.WeightHandle` s under
    ``launcher.options.weights`` ``object_store`` / ``dist`` (the actor fetches
    or has received the bytes; see :mod:`.weights`). Under ``driver`` they
    arrive as buckets held here, and go to the actor through the Ray object
    store: each bucket is ``ray.put`` once per version and the references are
    shared by every replica (``bucket_cache``). :meth:`restart` replaces a dead actor with a
    fresh one in the same placement bundle; the rollout stage then pushes the
    current weights into it before giving it work.
    """

    #: its engine runs in another process (a dispatcher may start several such replicas at once)
    out_of_process = True

    def __init__(self, watched: WatchedActor, *, deadline_s: float, max_restarts: int,
                 bucket_cache: dict[int, Any], counters: Counter[str], weights: RayWeights | None = None,
                 restart_counter: str = "rollout_actor_restarts") -> None:
        self.watched = watched
        self.restart_counter = restart_counter  #: the counter each replacement adds to (a judge's: its own)
        self.deadline_s = deadline_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self.bucket_cache = bucket_cache  #: (version, index) -> (bucket, ObjectRef), shared by a run's replicas
        self.weights = weights  #: the run's weight path when it is not ``driver`` (handles instead of buckets)
        self.counters = counters
        self._calls = itertools.count()
        self._desc = _Description(watched)
        self._shut = False
        self._submitting: set[asyncio.Future] = set()  #: submit calls sent and not yet returned
        self._adapter: Any = None  #: the LoRA spec given to configure_adapter, given again to every new actor

    @property
    def features(self):  # type: ignore[override]
        # the actor's engine's features, and restart(): this proxy replaces a dead actor with a fresh one
        return self._desc.get()["features"].model_copy(update={"supports_restart": self.max_restarts > 0})

    @property
    def version(self) -> int:
        return self._desc.version

    @property
    def pid(self) -> int:
        return int(self._desc.get()["pid"])

    def configure_adapter(self, spec: Any) -> None:  # type: ignore[override]
        """Kept and handed to the actor's engine in :meth:`start` (before it loads), for this actor and every
        actor that replaces it."""
        if not self.features.supports_adapter_updates:
            super().configure_adapter(spec)  # the documented UnsupportedFeatureError
        self._adapter = spec

    async def start(self) -> None:
        """Start the engine; an actor lost while starting is replaced (within ``max_restarts``) and started again."""
        while True:
            try:
                await self._desc.fetch()
                if self._adapter is not None:
                    await self.watched.call("configure_adapter", self._adapter,
                                            timeout=self.watched.heartbeat_timeout_s * 5)
                self._desc.version = int(await self.watched.call("start",
                                                                 timeout=self.watched.heartbeat_timeout_s * 5))
                return
            except RoleLost:
                await self._replace()

    async def restart(self) -> None:
        """Replace the actor (dead or not) with a fresh, started one; :class:`EngineError` when out of restarts."""
        if self.max_restarts == 0:
            raise UnsupportedFeatureError(f"{self.watched.role}: restarts are off (launcher.options.max_restarts=0)")
        await self._replace()
        await self.start()

    def _after_spawn(self) -> None:
        self._desc = _Description(self.watched)

    async def generate(  # type: ignore[override]
        self, requests: Sequence[GenerationRequest]
    ) -> AsyncIterator[GenerationResult]:
        call_id = next(self._calls)
        submit = asyncio.ensure_future(self.watched.call("submit", call_id, list(requests),
                                                         timeout=self.watched.heartbeat_timeout_s))
        self._submitting.add(submit)
        try:
            await submit
        finally:
            self._submitting.discard(submit)
        while True:
            results, done, error = await self.watched.call(
                "poll", call_id, POLL_S, timeout=POLL_S + self.watched.heartbeat_timeout_s)
            for res in results:
                yield res
            if error is not None:
                raise error  # the engine's own exception, as an in-process engine would raise it
            if done:
                return

    async def _after_submits(self) -> None:
        """Wait for generate() calls already sent to reach the engine.

        An async actor may start calls out of order. An abort or a pause sent
        after a submit must find that submit's requests in flight, as it would
        in process.
        """
        if self._submitting:
            await asyncio.wait(list(self._submitting))

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        await self._after_submits()
        return await self.watched.call("abort", None if request_ids is None else list(request_ids),
                                       timeout=self.watched.heartbeat_timeout_s)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        await self._after_submits()
        await self.watched.call("pause", mode, timeout=self.deadline_s)

    async def resume(self) -> None:
        await self.watched.call("resume", timeout=self.watched.heartbeat_timeout_s)

    async def update_weights(self, version: int, buckets: AsyncIterable[WeightBucket | WeightHandle], *,
                             kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE) -> None:
        items = [b async for b in buckets]
        if items and isinstance(items[0], WeightHandle):
            if self.weights is None:
                raise WeightTransferError(f"{self.watched.role}: weight handles need the run's RayWeights")
            self._desc.version = await self.weights.load(self, version, items, kv_cache)  # type: ignore[arg-type]
            return
        refs = []
        for b in items:
            key = (b.version, b.index)
            cached = self.bucket_cache.get(key)
            if cached is not None and cached[0] is b:
                ref = cached[1]  # the very bucket another replica already put: share its object
            else:
                for old in [k for k in self.bucket_cache if k[0] < b.version]:
                    del self.bucket_cache[old]  # every replica moves forward; older versions are never asked again
                ref = ray.put(b)
                self.bucket_cache[key] = (b, ref)  # holding the bucket keeps the identity check sound
            refs.append(ref)
        # the actor receives the buckets themselves (Ray resolves top-level arguments only), so pass a list of
        # references and let the actor fetch them: one copy out of the object store per replica, none through us
        self._desc.version = int(await self.watched.call("update_weights_refs", version, refs, kv_cache,
                                                         timeout=self.deadline_s))

    async def sleep(self, level: int = 1) -> None:
        await self.watched.call("sleep", level, timeout=self.deadline_s)

    async def wake_up(self) -> None:
        await self.watched.call("wake_up", timeout=self.deadline_s)

    async def health(self) -> Health:
        return await super().health()


# -------------------------------------------------------------------------------------------- train


class RemoteTrainEngine(_ActorProxy, TrainEngine):
    """A :class:`TrainEngine` in a Ray actor. Checkpoint paths must be readable by the actor (one host, or shared)."""

    shutdown_timeout_s = 60.0  #: its ranks stop inside the actor first

    def __init__(self, watched: WatchedActor, *, deadline_s: float, step_timeout_s: float | None = None,
                 weights: RayWeights | None = None) -> None:
        self.watched = watched
        self.deadline_s = deadline_s
        self.step_timeout_s = step_timeout_s
        self.weights = weights  #: the run's weight path; ``driver`` (or None): every bucket comes back here
        self._desc = _Description(watched)
        self._shut = False

    @property
    def features(self):  # type: ignore[override]
        return self._desc.get()["features"]

    @property
    def version(self) -> int:
        return self._desc.version

    @property
    def pid(self) -> int:
        return int(self._desc.get()["pid"])

    async def setup(self) -> None:
        await self._desc.fetch()
        self._desc.version = int(await self.watched.call("setup"))

    async def compute_logprobs(self, batch: Any, *, values: bool = False) -> Any:
        return await self.watched.call("compute_logprobs", batch, values, timeout=self.step_timeout_s)

    async def train_step(self, batch: Any, algorithm: Any) -> dict[str, float]:
        metrics, self._desc.version = await self.watched.call("train_step", batch, algorithm,
                                                              timeout=self.step_timeout_s)
        return metrics

    async def export_weights(  # type: ignore[override]
        self, *, bucket_bytes: int
    ) -> AsyncIterator[WeightBucket | WeightHandle]:
        """The current version: buckets (``weights: driver``), or handles whose bytes never come to the driver."""
        if self.weights is not None and self.weights.mode != "driver":
            for h in await self.weights.export(self.watched, bucket_bytes):
                yield h
            return
        for b in await self.watched.call("export_weights", bucket_bytes, timeout=self.deadline_s):
            yield b

    async def save(self, path: Path) -> None:
        await self.watched.call("save", str(Path(path).resolve()))  # the actor may run elsewhere

    async def load(self, path: Path) -> None:
        self._desc.version = int(await self.watched.call("load", str(Path(path).resolve())))

    async def export_pretrained(self, path: Path) -> None:
        await self.watched.call("export_pretrained", str(Path(path).resolve()))



# ------------------------------------------------------------------------------------------- reward


class RemoteRewardPool:
    """A reward whose scoring runs in a pool of Ray actors, one batch per call.

    The reward stage hands it a whole leased batch (``score_many``); the batch
    goes to the least busy worker. A worker that dies is replaced (up to
    ``max_restarts`` times per worker) and the batch is scored again on
    another: the stage still holds the rows' lease, so nothing is lost or
    scored into the store twice.
    """

    def __init__(self, workers: list[WatchedActor], *, max_restarts: int, counters: Counter[str]) -> None:
        self.workers = workers
        self.busy = [0] * len(workers)
        self.restarts = [0] * len(workers)
        self.max_restarts = max_restarts
        self.counters = counters
        self._desc = _Description(workers[0])

    @property
    def needs_text(self) -> bool:
        """Whether the reward reads decoded text (the reward stage skips decoding when not)."""
        return bool(self._desc.get()["needs_text"])

    @property
    def features(self) -> RewardFeatures:
        """Batch scoring always (one round trip per batch); decoded text and extra values as the reward behind it
        declares."""
        return RewardFeatures(needs_text=self.needs_text, supports_score_many=True,
                              extras=tuple(self._desc.get().get("extras", ())))

    def score(self, sample: RewardInput) -> Any:
        return self._one(sample)

    async def _one(self, sample: RewardInput) -> Any:
        [(ok, value)] = await self.score_many([sample], timeout_s=3600.0)
        if not ok:
            raise RuntimeError(value)
        return value

    async def score_many(self, samples: list[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        """``(True, value)`` or ``(False, why)`` per sample; retried on another worker when one dies."""
        last: RoleLost | None = None
        for _ in range(len(self.workers) * (self.max_restarts + 1) + 1):
            for i, w in enumerate(self.workers):
                if w.lost is not None and self.restarts[i] < self.max_restarts:
                    last = w.lost  # died between batches (its heartbeat found out): replace it now
                    self._replace(i)
            alive = [i for i, w in enumerate(self.workers) if w.lost is None]
            if not alive:
                break
            i = min(alive, key=lambda j: self.busy[j])
            w = self.workers[i]
            self.busy[i] += 1
            try:
                # a whole batch may take timeout_s per sample, plus the heartbeat's grace
                return await w.call("score_many", samples, timeout_s,
                                    timeout=timeout_s * max(1, len(samples)) + w.heartbeat_timeout_s)
            except RoleLost as exc:
                last = exc
                self.counters["reward_batches_retried"] += 1
            finally:
                self.busy[i] -= 1
        raise EngineError(f"every reward worker died (last: {last}); see launcher.options.max_restarts")

    def _replace(self, i: int) -> None:
        self.restarts[i] += 1
        self.counters["reward_actor_restarts"] += 1
        self.workers[i].kill()
        self.workers[i].spawn()

    async def shutdown(self) -> None:
        for w in self.workers:
            w.kill()


class RemoteRewardModel(_RestartableProxy):
    """One reward-model replica in a Ray actor (see :class:`~.actors.RewardModelActor`), as the reward in the
    driver sees a replica: ``start``, ``score_many``, ``restart``, ``shutdown``.

    Built once per run, in the reward model's own placement group. A call
    races the actor's death and a deadline like every proxy's: a dead actor
    fails the batch in flight at once with :class:`RoleLost` (the reward
    fails those samples with the reason), and the reward's pool then calls
    :meth:`restart`, which puts a fresh actor in the same bundle (up to
    ``max_restarts`` times; counted as ``reward_model_restarts``).
    """

    out_of_process = True

    def __init__(self, watched: WatchedActor, *, max_restarts: int, counters: Counter[str],
                 start_timeout_s: float) -> None:
        self.watched = watched
        self.max_restarts = max_restarts
        self.restarts = 0
        self.counters = counters
        self.start_timeout_s = start_timeout_s  #: loading a model may take a while (the heartbeat still runs)
        self.restart_counter = "reward_model_restarts"
        self._shut = False

    @property
    def features(self) -> Any:
        from asyncflow_core.interfaces.features import RolloutFeatures

        return RolloutFeatures(supports_restart=self.max_restarts > 0)

    async def describe(self) -> dict[str, Any]:
        """The actor's pid (the process that holds the model)."""
        return await self.watched.call("describe", timeout=self.watched.heartbeat_timeout_s * 5)

    async def start(self) -> None:
        """Load the model in the actor; an actor lost while loading is replaced (within ``max_restarts``)."""
        while True:
            try:
                await self.watched.call("start", timeout=self.start_timeout_s)
                return
            except RoleLost:
                await self._replace()

    async def score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        # the replica answers within timeout_s (the reward's own wait); past that and the heartbeat's grace the
        # actor is hung: RoleTimeout kills it, and the reward restarts it
        return await self.watched.call("score_many", list(samples), timeout_s,
                                       timeout=timeout_s + self.watched.heartbeat_timeout_s)

    async def restart(self) -> None:
        """Replace the actor (dead or not) with a fresh, loaded one; :class:`EngineError` when out of restarts."""
        await self._replace()
        await self.start()



#: RoleLost, RoleTimeout and WatchedActor live in :mod:`.watch`; named here too, where the proxies' callers look
__all__ = ["POLL_S", "RemoteRewardModel", "RemoteRewardPool", "RemoteRolloutEngine", "RemoteTrainEngine", "RoleLost",
           "RoleTimeout", "WatchedActor"]
