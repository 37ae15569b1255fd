"""How a pool's replicas follow the weights the trainer publishes, per :class:`WeightPolicy`.

- :attr:`WeightPolicy.TRAINING` (rollout replicas): load every published
  version, the replica's next one first;
- :attr:`WeightPolicy.PINNED` (eval replicas): load one given version once it
  is staged, then stay on it;
- :attr:`WeightPolicy.FROZEN` (reference models, judges): never load
  published weights (the engine keeps the weights it started with).

A load happens at a safe point: in flight when the engine supports it,
otherwise pause(abort) -> update -> resume, the replica taking no new work
meanwhile (:meth:`EnginePool.begin_update`). Only the training policy is
used by the runtime today; the other two are covered by
``tests/flow/test_weight_follower.py``.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from asyncflow_core.errors import EngineError
from asyncflow_core.flow.engine_pool import EnginePool, Replica
from asyncflow_core.interfaces import KVCachePolicy, PauseMode, WeightTransport
from asyncflow_core.types import WeightBucket


class WeightPolicy(enum.Enum):
    """Which published versions a pool's replicas load."""

    TRAINING = "training"  #: every published version
    PINNED = "pinned"  #: one version, then never again
    FROZEN = "frozen"  #: none


class WeightFollower:
    """Loads published weights from ``transport`` into ``pool``'s replicas under ``policy``."""

    def __init__(self, transport: WeightTransport, pool: EnginePool, *, deadline_s: float,
                 kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE, policy: WeightPolicy = WeightPolicy.TRAINING,
                 pinned_version: int | None = None, hold: Callable[[Replica], bool] | None = None) -> None:
        if (policy is WeightPolicy.PINNED) != (pinned_version is not None):
            raise ValueError("a pinned weight policy needs pinned_version, and only it takes one")
        self.transport = transport
        self.pool = pool
        self.deadline_s = deadline_s
        self.kv_cache = kv_cache
        self.policy = policy
        self.pinned_version = pinned_version
        #: ``hold(r)`` True keeps replica ``r`` on its version for now (its share of an evaluation pinned to that
        #: version is not done); the follower loads once it turns False and the context is notified (any notify:
        #: with a hold the follower's wait is checked on every one, without one only on those of no key or ``r``'s)
        self.hold = hold

    def wants(self, engine_version: int, published: int) -> bool:
        """Whether a replica on ``engine_version`` should load now that ``published`` is staged."""
        if self.policy is WeightPolicy.TRAINING:
            return published > engine_version
        if self.policy is WeightPolicy.PINNED:
            return engine_version < self.pinned_version <= published  # type: ignore[operator]
        return False

    def needs_reload(self, engine_version: int, published: int, *, pushed: bool) -> bool:
        """Whether a freshly restarted replica must load staged weights before it works (``pushed``: a version
        was staged before the run started generating)."""
        if self.policy is WeightPolicy.TRAINING:
            return pushed or published > engine_version
        if self.policy is WeightPolicy.PINNED:
            return published >= self.pinned_version  # type: ignore[operator]
        return False

    def target(self, engine_version: int, min_version: int | None = None) -> int | None:
        """The oldest version a load may take (None: this policy loads nothing)."""
        if self.policy is WeightPolicy.TRAINING:
            return engine_version + 1 if min_version is None else min_version
        if self.policy is WeightPolicy.PINNED:
            return self.pinned_version
        return None

    async def load(self, r: Replica, *, min_version: int | None = None) -> bool:
        """Pull the newest staged version allowed (``min_version``: default the replica's next) into ``r``.

        Returns whether the replica was paused (its in-flight requests aborted) for it. A pinned follower
        that finds a version other than its pin staged raises :class:`EngineError`.
        """
        want = self.target(r.engine.version, min_version)
        if want is None:
            return False
        stream = self.transport.receive(min_version=want, deadline_s=self.deadline_s)
        first = await stream.__anext__()
        if self.policy is WeightPolicy.PINNED and first.version != self.pinned_version:
            if hasattr(stream, "aclose"):
                await stream.aclose()
            raise EngineError(f"replica {r.index} is pinned to weights version {self.pinned_version}, but the "
                              f"transport now holds version {first.version}; load the pin before the next publish")

        async def chain() -> AsyncIterator[WeightBucket]:
            yield first
            async for b in stream:
                yield b

        feats = r.engine.features
        if r.inflight and not feats.supports_inflight_weight_update and feats.supports_pause_abort:
            self.pool.begin_update(r)
            try:
                await r.engine.pause(PauseMode.ABORT)
                await r.engine.update_weights(first.version, chain(), kv_cache=self.kv_cache)
            finally:
                self.pool.end_update(r)
                await r.engine.resume()
            return True
        await r.engine.update_weights(first.version, chain(), kv_cache=self.kv_cache)
        return False

    async def follow(self, r: Replica, gen: int, ctx: Any, *, on_failed: Callable[[Replica, BaseException],
                     Awaitable[None]], on_updated: Callable[[Replica], Awaitable[None]]) -> None:
        """Load what the policy wants into incarnation ``gen`` of ``r`` until it dies or the run stops.

        ``ctx`` is the run's context (``published``, ``wait_for``, ``stop``, ``timeline``, ``counters``). An
        :class:`EngineError` (the engine died or missed the deadline) goes to ``on_failed`` and ends the task.
        """
        if r.sync_generation == gen:
            return  # already running: a replica restarted before the stage ran gets its task from both places
        r.sync_generation = gen
        if self.policy is WeightPolicy.FROZEN:
            return
        while not ctx.stop.is_set() and not r.dead and r.generation == gen:
            # keyed by the replica (a notify of another key skips it) unless a hold, which may lift unannounced, applies
            await ctx.wait_for(lambda: (self.wants(r.engine.version, ctx.published)
                                        and not (self.hold is not None and self.hold(r)))
                               or r.dead or r.generation != gen, key=r.index if self.hold is None else None)
            if ctx.stop.is_set() or r.dead or r.generation != gen:
                return
            try:
                with ctx.timeline.span(r.lane, "update_weights"):
                    paused = await self.load(r)
            except EngineError as exc:
                # a replaceable replica gets the update again after its restart; otherwise it is dead like any
                # failed engine
                if r.generation == gen:
                    await on_failed(r, exc)
                return
            if paused:
                ctx.counters["paused_for_update"] += 1
            ctx.counters["weight_updates"] += 1
            await on_updated(r)
