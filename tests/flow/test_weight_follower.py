"""WeightFollower on its own: the three policies, the pause/abort rule, and the follow loop.

Uses a fake engine and a fake transport (they record calls; buckets are
bare namespaces with a version) and a real FlowContext without a store.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from asyncflow_core.errors import EngineError
from asyncflow_core.flow.engine_pool import EnginePool, ReplicaState
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.flow.weight_follower import WeightFollower, WeightPolicy
from asyncflow_core.interfaces import PauseMode
from asyncflow_core.interfaces.features import RolloutFeatures


class FakeTransport:
    def __init__(self) -> None:
        self.staged = 0
        self.asked: list[int] = []

    async def receive(self, *, min_version: int, deadline_s: float):
        self.asked.append(min_version)
        if self.staged < min_version:
            raise EngineError(f"no version >= {min_version} within {deadline_s}s")
        for i in range(2):
            yield SimpleNamespace(version=self.staged, index=i, last=i == 1)


class FakeEngine:
    def __init__(self, pool_box: list, **feats: bool) -> None:
        self.features = RolloutFeatures(**feats)
        self.version = 0
        self.calls: list[tuple] = []
        self.pool_box = pool_box
        self.fail_next = False

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def resume(self):
        self.calls.append(("resume",))

    async def update_weights(self, version, buckets, *, kv_cache):
        n = len([b async for b in buckets])
        state = self.pool_box[0][0].state
        self.calls.append(("update", version, n, state))
        if self.fail_next:
            raise EngineError("engine died during the update")
        self.version = version


def _setup(policy=WeightPolicy.TRAINING, pinned=None, **feats):
    box: list = []
    pool = EnginePool([FakeEngine(box, **feats)], max_inflight=4)
    box.append(pool)
    transport = FakeTransport()
    return pool, transport, WeightFollower(transport, pool, deadline_s=1.0, policy=policy, pinned_version=pinned)


def _ctx() -> FlowContext:
    return FlowContext(store=None, timeline=Timeline(time.monotonic), ledger=Ledger(), k=1, prompts_per_step=1,
                       n=1, clock=time.monotonic)


def test_training_loads_the_next_version_in_flight_when_nothing_is_running():
    pool, transport, f = _setup()
    transport.staged = 2
    assert f.wants(0, 2) and not f.wants(2, 2) and f.target(0) == 1 and f.target(0, 2) == 2
    assert asyncio.run(f.load(pool[0])) is False
    assert transport.asked == [1] and pool[0].engine.version == 2
    assert pool[0].engine.calls == [("update", 2, 2, ReplicaState.READY)]
    assert f.needs_reload(2, 2, pushed=True) and f.needs_reload(1, 2, pushed=False)
    assert not f.needs_reload(2, 2, pushed=False)


def test_an_engine_that_cannot_update_in_flight_is_paused_with_abort_and_takes_no_work_meanwhile():
    pool, transport, f = _setup(supports_inflight_weight_update=False, supports_pause_abort=True)
    r = pool[0]
    pool.assign(r, "q", object())
    transport.staged = 1
    assert asyncio.run(f.load(r)) is True
    assert r.engine.calls == [("pause", PauseMode.ABORT), ("update", 1, 2, ReplicaState.UPDATING), ("resume",)]
    assert r.state is ReplicaState.READY


def test_an_engine_that_updates_in_flight_is_not_paused():
    pool, transport, f = _setup(supports_inflight_weight_update=True)
    pool.assign(pool[0], "q", object())
    transport.staged = 1
    assert asyncio.run(f.load(pool[0])) is False
    assert [c[0] for c in pool[0].engine.calls] == ["update"]


def test_pinned_loads_its_version_once_and_refuses_another():
    with pytest.raises(ValueError):
        WeightFollower(FakeTransport(), EnginePool([], max_inflight=1), deadline_s=1, policy=WeightPolicy.PINNED)
    pool, transport, f = _setup(WeightPolicy.PINNED, pinned=2)
    assert not f.wants(0, 1) and f.wants(0, 2) and f.wants(0, 3) and not f.wants(2, 5)
    assert f.target(0) == 2 and not f.needs_reload(0, 1, pushed=True) and f.needs_reload(0, 2, pushed=False)
    transport.staged = 2
    asyncio.run(f.load(pool[0]))
    assert pool[0].engine.version == 2
    pool2, transport2, f2 = _setup(WeightPolicy.PINNED, pinned=2)
    transport2.staged = 3  # the pin was never loaded and is gone
    with pytest.raises(EngineError, match="pinned to weights version 2"):
        asyncio.run(f2.load(pool2[0]))
    assert pool2[0].engine.version == 0 and pool2[0].engine.calls == []


def test_frozen_never_loads():
    pool, transport, f = _setup(WeightPolicy.FROZEN)
    transport.staged = 5
    assert not f.wants(0, 5) and f.target(0, 5) is None and not f.needs_reload(0, 5, pushed=True)
    assert asyncio.run(f.load(pool[0], min_version=5)) is False
    assert transport.asked == [] and pool[0].engine.version == 0

    async def follow():
        ctx = _ctx()
        ctx.published = 5
        await asyncio.wait_for(f.follow(pool[0], 0, ctx, on_failed=None, on_updated=None), 5)

    asyncio.run(follow())  # returns at once: nothing to follow


async def _publish(ctx, transport, v):
    transport.staged = v
    ctx.published = v
    await ctx.notify()
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("policy,pinned,expect", [(WeightPolicy.TRAINING, None, [1, 2, 3]),
                                                  (WeightPolicy.PINNED, 2, [2])])
def test_follow_loads_what_the_policy_wants_as_versions_are_published(policy, pinned, expect):
    pool, transport, f = _setup(policy, pinned)
    r = pool[0]
    loaded: list[int] = []

    async def on_updated(rep):
        loaded.append(rep.engine.version)

    async def main():
        ctx = _ctx()
        task = asyncio.ensure_future(f.follow(r, r.generation, ctx, on_failed=None, on_updated=on_updated))
        await asyncio.sleep(0)
        # a second follow for the same incarnation returns at once
        await asyncio.wait_for(f.follow(r, r.generation, ctx, on_failed=None, on_updated=None), 5)
        for v in (1, 2, 3):
            await _publish(ctx, transport, v)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ctx

    ctx = asyncio.run(main())
    assert loaded == expect and r.engine.version == expect[-1]
    assert ctx.counters["weight_updates"] == len(expect)


def test_follow_hands_an_engine_error_to_on_failed_and_ends():
    pool, transport, f = _setup()
    r = pool[0]
    failed: list[str] = []

    async def on_failed(rep, exc):
        failed.append(str(exc))
        pool.mark_dead(rep, exc, restartable=False)

    async def main():
        ctx = _ctx()
        task = asyncio.ensure_future(f.follow(r, r.generation, ctx, on_failed=on_failed, on_updated=None))
        await asyncio.sleep(0)
        r.engine.fail_next = True
        await _publish(ctx, transport, 1)
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert failed == ["engine died during the update"] and r.dead and r.engine.version == 0


def test_a_held_replica_stays_on_its_version_until_released():
    """``hold`` (an evaluation pinned to the replica's version) defers the load; releasing it loads the newest."""
    pool, transport, _ = _setup()
    held = {"on": True}
    f = WeightFollower(transport, pool, deadline_s=1.0, hold=lambda rep: held["on"])
    r = pool[0]
    loaded: list[int] = []

    async def on_updated(rep):
        loaded.append(rep.engine.version)

    async def main():
        ctx = _ctx()
        task = asyncio.ensure_future(f.follow(r, r.generation, ctx, on_failed=None, on_updated=on_updated))
        await asyncio.sleep(0)
        for v in (1, 2):
            await _publish(ctx, transport, v)
        assert loaded == [] and r.engine.version == 0  # held: nothing loaded while versions were published
        held["on"] = False
        await ctx.notify()
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert loaded == [2] and r.engine.version == 2  # the newest staged version, in one load


def test_a_replicas_wait_is_keyed_unless_a_hold_can_lift_unannounced():
    """Without a hold, only notifies of no key or the replica's own index check its follower; with a hold, every one."""
    held = {"on": True}

    async def main(hold) -> list:
        box: list = []
        pool = EnginePool([FakeEngine(box), FakeEngine(box)], max_inflight=4)
        box.append(pool)
        transport = FakeTransport()
        f = WeightFollower(transport, pool, deadline_s=1.0, hold=hold)
        ctx = _ctx()
        loaded: list[int] = []

        async def on_updated(rep):
            loaded.append(rep.index)

        tasks = [asyncio.ensure_future(f.follow(r, r.generation, ctx, on_failed=None, on_updated=on_updated))
                 for r in pool.replicas]
        await _publish(ctx, transport, 1)
        keyed = {k: len(v) for k, v in ctx.waiting_on.items()}
        held["on"] = False  # lifts with no notify naming either replica
        await ctx.notify("another key")
        for _ in range(20):
            await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [keyed, sorted(loaded)]

    keyed, loaded = asyncio.run(main(None))
    assert keyed == {0: 1, 1: 1} and loaded == [0, 1]  # loaded at the publish; waiting again, keyed by replica
    keyed, loaded = asyncio.run(main(lambda rep: held["on"]))
    assert keyed == {} and loaded == [0, 1]  # unkeyed: the other key's notify found both holds lifted
