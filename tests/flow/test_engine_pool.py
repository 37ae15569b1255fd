"""EnginePool on its own: slots, states and their counts, death, restart, sleep/wake, abort-by-id.

Uses fake engines (a few attributes and recorded calls), no runtime, store or model.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

import pytest

from asyncflow_core.flow.engine_pool import EnginePool, ReplicaState
from asyncflow_core.interfaces.features import RolloutFeatures


class FakeEngine:
    def __init__(self, *, restartable: bool = False, restart_fails: int = 0, **feats: bool) -> None:
        self.features = RolloutFeatures(supports_restart=restartable, **feats)
        self.version = 0
        self.calls: list[tuple] = []
        self.restart_fails = restart_fails
        if restartable:
            self.restart = self._restart

    async def _restart(self) -> None:
        self.calls.append(("restart",))
        if self.restart_fails:
            self.restart_fails -= 1
            raise RuntimeError("no capacity")

    async def abort(self, ids):
        self.calls.append(("abort", tuple(ids)))

    async def sleep(self, level):
        self.calls.append(("sleep", level))

    async def wake_up(self):
        self.calls.append(("wake_up",))


def _span(lane, name):
    return contextlib.nullcontext()


def _check_counts(pool: EnginePool) -> None:
    """The pool's kept counts equal what the replicas' states and loads say."""
    assert pool.alive == sum(r.state in (ReplicaState.READY, ReplicaState.UPDATING) for r in pool)
    assert pool.inflight_total == sum(len(r.inflight) for r in pool)


def test_dispatch_takes_the_replica_with_most_free_slots_lowest_index_on_ties():
    pool = EnginePool([FakeEngine() for _ in range(3)], max_inflight=2)
    picked = []
    for i in range(6):
        aside: list = []
        r = pool.next_replica(aside)
        pool.put_back(aside)
        pool.assign(r, f"q{i}", i)
        picked.append(r.index)
    assert picked == [0, 1, 2, 0, 1, 2]
    assert pool.next_replica([]) is None and pool.free_slots() == 0
    assert pool.release(pool[1], "q1") == 1 and pool.release(pool[1], "q1") is None
    assert pool.next_replica([]).index == 1 and pool.free_slots() == 1
    _check_counts(pool)


def test_a_replica_the_owner_holds_back_is_set_aside_then_offered_again():
    held = {0}
    pool = EnginePool([FakeEngine(), FakeEngine()], max_inflight=4, may_start=lambda r: r.index not in held)
    aside: list = []
    assert pool.next_replica(aside).index == 1
    assert [idx for _, idx in aside] == [0]
    pool.put_back(aside)
    assert pool.free_slots() == 4
    held.clear()
    assert pool.next_replica([]).index == 0 and pool.free_slots() == 8


def test_a_request_the_replica_does_not_suit_sets_it_aside_for_that_request_only():
    pool = EnginePool([FakeEngine(), FakeEngine()], max_inflight=4)
    pool[1].engine.version = 3
    aside: list = []
    assert pool.next_replica(aside, lambda r: r.engine.version >= 3).index == 1  # 0 has more free slots: tie
    assert [idx for _, idx in aside] == [0]
    assert pool.next_replica([], lambda r: r.engine.version >= 4) is None
    pool.put_back(aside)
    assert pool.next_replica([]).index == 0 and pool.free_slots() == 8


def test_death_returns_the_orphans_and_a_restartable_replica_revives():
    pool = EnginePool([FakeEngine(restartable=True), FakeEngine()], max_inflight=4)
    r0, r1 = pool
    pool.assign(r0, "a", "A")
    pool.assign(r0, "b", "B")
    assert pool.mark_dead(r0, RuntimeError("oom"), restartable=pool.restartable(r0)) == ["A", "B"]
    assert r0.state is ReplicaState.REVIVING and r0.dead and r0.generation == 1
    assert pool.mark_dead(r0, RuntimeError("again"), restartable=True) is None  # already dead
    assert pool.alive == 1 and pool.inflight_total == 0 and "oom" in pool.last_death
    assert not pool.all_dead() and not pool.eligible(r0)
    assert pool.mark_dead(r1, RuntimeError("gone"), restartable=pool.restartable(r1)) == []
    assert r1.state is ReplicaState.DEAD and not pool.all_dead()  # r0 is still being restarted
    reloads = []

    async def reload(r):
        reloads.append(r.index)

    assert asyncio.run(pool.restart(r0, reload, span=_span)) is True
    assert r0.state is ReplicaState.READY and reloads == [0] and pool.alive == 1
    assert pool.next_replica([]) is r0
    _check_counts(pool)


def test_a_failed_restart_leaves_it_dead_and_a_failed_reload_restarts_again():
    eng = FakeEngine(restartable=True, restart_fails=1)
    pool = EnginePool([eng], max_inflight=1)
    pool.mark_dead(pool[0], RuntimeError("x"), restartable=True)
    assert asyncio.run(pool.restart(pool[0], lambda r: asyncio.sleep(0), span=_span)) is False
    assert pool[0].state is ReplicaState.DEAD and pool.all_dead() and "restart failed" in pool.last_death

    eng2 = FakeEngine(restartable=True)
    pool2 = EnginePool([eng2], max_inflight=1)
    pool2.mark_dead(pool2[0], RuntimeError("x"), restartable=True)
    tries = []

    async def flaky_reload(r):
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("weights did not load")

    assert asyncio.run(pool2.restart(pool2[0], flaky_reload, span=_span)) is True
    assert eng2.calls.count(("restart",)) == 2 and pool2.alive == 1


def test_an_updating_replica_takes_no_work_and_one_that_died_meanwhile_stays_dead():
    pool = EnginePool([FakeEngine()], max_inflight=2)
    r = pool[0]
    pool.begin_update(r)
    assert r.updating and pool.alive == 1 and pool.free_slots() == 0
    pool.end_update(r)
    assert r.state is ReplicaState.READY and pool.free_slots() == 2
    pool.begin_update(r)
    pool.mark_dead(r, RuntimeError("x"), restartable=False)
    pool.end_update(r)
    assert r.state is ReplicaState.DEAD and pool.alive == 0


def test_abort_by_id_only_where_the_engine_can():
    pool = EnginePool([FakeEngine(), FakeEngine(supports_abort=False)], max_inflight=2)
    assert asyncio.run(pool.abort(pool[0], ["q1", "q2"])) is True
    assert pool[0].engine.calls == [("abort", ("q1", "q2"))]
    assert asyncio.run(pool.abort(pool[1], ["q3"])) is False and pool[1].engine.calls == []
    assert asyncio.run(pool.abort(pool[0], [])) is False


def test_sleep_and_wake_reach_live_replicas_that_support_it():
    pool = EnginePool([FakeEngine(supports_sleep=True), FakeEngine(), FakeEngine(supports_sleep=True)],
                      max_inflight=1)
    pool.mark_dead(pool[2], RuntimeError("x"), restartable=False)
    asyncio.run(pool.sleep_all())
    assert pool[0].asleep and not pool[1].asleep and not pool[2].asleep
    assert [c[0] for c in pool[0].engine.calls] == ["sleep"] and pool[2].engine.calls == []
    asyncio.run(pool.wake_all())
    assert not pool[0].asleep and pool[0].engine.calls[-1] == ("wake_up",) and pool[1].engine.calls == []


@pytest.mark.parametrize("seed", range(5))
def test_counts_follow_any_sequence_of_changes(seed):
    rng = random.Random(seed)
    pool = EnginePool([FakeEngine(restartable=True) for _ in range(4)], max_inflight=3)
    n = 0
    for _ in range(300):
        r = pool[rng.randrange(4)]
        op = rng.randrange(6)
        if op == 0:
            nxt = pool.next_replica([])
            if nxt is not None:
                pool.assign(nxt, f"q{n}", n)
                n += 1
        elif op == 1 and r.inflight:
            pool.release(r, rng.choice(list(r.inflight)))
        elif op == 2 and rng.random() < 0.2:
            pool.mark_dead(r, RuntimeError("x"), restartable=rng.random() < 0.7)
        elif op == 3 and r.reviving:
            asyncio.run(pool.restart(r, lambda q: asyncio.sleep(0), span=_span))
        elif op == 4:
            pool.begin_update(r)
        else:
            pool.end_update(r)
        _check_counts(pool)
        assert pool.free_slots() == sum(3 - len(q.inflight) for q in pool if q.state is ReplicaState.READY)
    assert n > 0


def test_a_replica_record_reads_like_before():
    r = EnginePool([SimpleNamespace(features=RolloutFeatures())], max_inflight=1)[0]
    assert r.lane == "rollout/0" and not r.dead and not r.reviving and not r.updating
