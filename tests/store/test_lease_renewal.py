"""Lease renewal: ``Controller.renew`` and ``LeaseKeeper`` (every deployment's ``renew`` runs the StoreSpec suite)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from asyncflow_spec.store import FakeClock

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store import LeaseKeeper
from asyncflow_core.store.controller import Controller
from asyncflow_core.store.errors import InvalidRequestError, LeaseError, StoreTimeoutError
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.store.sync import SyncStore
from asyncflow_core.types import RaggedTensor


def _ctl(rows: int = 4) -> Controller:
    c = Controller(64, default_lease_s=10.0)
    c.register_task("gen", produces=["p"])
    c.register_task("roll", consumes=["p"])
    ids = c.add_rows(rows)
    c.mark_ready(ids, ["p"])
    return c


def _lease(c: Controller, n: int = 1, now: float = 0.0, lease_s: float | None = None, consumer: str | None = None):
    return c.try_lease("roll", ("p",), n, None, None, None, False, lease_s, consumer, 0, 1, now)


def _free(c: Controller, now: float) -> int:
    """How many rows 'roll' can lease at ``now`` (leases them, then releases them)."""
    c.expire(now)
    m = c.try_lease("roll", ("p",), 64, None, None, None, True, None, None, 0, 1, now)
    if m is None:
        return 0
    c.release(m.lease_id)
    return len(m)


def test_renew_moves_the_deadline_from_now_and_the_old_deadline_no_longer_expires_it():
    c = _ctl()
    m = _lease(c, 2)
    assert m.deadline == 10.0
    assert c.renew(m.lease_id, now=7.0) is True
    assert c.lease_info(m.lease_id)["deadline"] == 17.0 and c.next_deadline() == 17.0
    assert c.expire(10.0) == ([], 17.0)  # the first deadline's heap entry is stale now
    assert _free(c, 16.9) == 2  # the other two rows; the renewed lease still holds its own
    assert c.expire(17.0)[0] == [m.lease_id]
    assert _free(c, 17.0) == 4
    assert c.stats()["leases_renewed"] == 1


def test_a_new_lease_s_applies_to_later_renewals_too():
    c = _ctl()
    m = _lease(c, 1, lease_s=5.0)
    assert c.renew(m.lease_id, lease_s=30.0, now=1.0)
    assert c.lease_info(m.lease_id)["deadline"] == 31.0
    assert c.renew(m.lease_id, now=20.0)  # its length is 30 s from now on
    assert c.lease_info(m.lease_id)["deadline"] == 50.0


def test_a_lease_past_its_deadline_cannot_be_renewed_its_rows_are_free_and_its_ack_fails():
    c = _ctl()
    m = _lease(c, 2)
    expired_before = c.stats()["leases_expired"]
    assert c.renew(m.lease_id, now=10.0) is False  # deadline reached before expire() ran: expired here
    assert c.lease_info(m.lease_id) is None and c.stats()["leases_expired"] == expired_before + 1
    assert _free(c, 10.0) == 4
    with pytest.raises(LeaseError, match="already expired"):
        c.ack(m.lease_id, now=10.0)
    assert c.renew(m.lease_id, now=10.0) is False  # and stays so
    m2 = _lease(c, 1, now=20.0)
    c.expire(30.0)
    assert c.renew(m2.lease_id, now=30.0) is False  # expired by expire()


def test_ack_after_renew_marks_rows_done_and_finished_leases_renew_to_false():
    c = _ctl(rows=4)
    m = _lease(c, 1)
    assert c.renew(m.lease_id, now=9.0)
    assert c.ack(m.lease_id, now=15.0) == 1  # past the first deadline, inside the renewed one
    assert c.stats()["rows_done"] == 1
    rel = _lease(c, 1, now=15.0)
    c.release(rel.lease_id)
    dead = _lease(c, 1, now=15.0, consumer="w")
    c.declare_dead("w")
    cleared = _lease(c, 1, now=15.0)
    c.clear()
    for lid in (m.lease_id, rel.lease_id, dead.lease_id, cleared.lease_id):
        assert c.renew(lid, now=16.0) is False


def test_renew_rejects_what_is_not_a_lease_and_a_bad_lease_s_without_changing_anything():
    c = _ctl()
    m = _lease(c, 1)
    with pytest.raises(LeaseError, match="no such lease was handed out"):
        c.renew(10**9, now=1.0)
    with pytest.raises(LeaseError):
        c.renew(None, now=1.0)  # type: ignore[arg-type]
    for bad in (0.0, -1.0, float("inf"), float("nan"), "10"):
        with pytest.raises(InvalidRequestError, match="lease_s must be a positive"):
            c.renew(m.lease_id, lease_s=bad, now=1.0)  # type: ignore[arg-type]
    assert c.lease_info(m.lease_id)["deadline"] == 10.0 and c.stats()["leases_renewed"] == 0


def test_state_dict_frees_renewed_leases_and_their_ids_renew_to_false_after_load():
    c = _ctl()
    m = _lease(c, 2)
    assert c.renew(m.lease_id, now=5.0)
    state = c.state_dict()
    fresh = Controller(64)
    fresh.load_state_dict(state)
    assert fresh.renew(m.lease_id, now=6.0) is False  # leases come back free, as before renewal existed
    assert _free(fresh, 6.0) == 4
    new = _lease(fresh, 1, now=6.0)
    assert new.lease_id > m.lease_id and fresh.renew(new.lease_id, now=7.0)
    assert fresh.stats()["leases_renewed"] == 2  # the counter survives the checkpoint
    older = Controller(64)  # a checkpoint from before renewal (no such counter) loads too
    older.load_state_dict({**state, "counters": {"rows_put": 4}})
    assert older.stats()["leases_renewed"] == 0


# ---------------------------------------------------------------------------------------- LeaseKeeper


def _ragged(n: int) -> RaggedTensor:
    return RaggedTensor.from_sequences([torch.tensor([i]) for i in range(n)], dtype=torch.int64)


class CountingStore(InProcessStore):
    """Counts the store calls ``renew`` makes (the keeper must make few)."""

    renew_calls = 0

    async def renew(self, meta, *, lease_s=None):
        self.renew_calls += 1
        await asyncio.sleep(0)  # a scheduling point: callers that ask meanwhile must share this call
        return await super().renew(meta, lease_s=lease_s)


async def _leased(store, n: int = 2, lease_s: float = 10.0) -> BatchMeta:
    await store.register_task("gen", produces=["p"])
    await store.register_task("roll", consumes=["p"])
    await store.put({"p": _ragged(n)})
    return await store.get_meta("roll", ["p"], n, lease_s=lease_s, timeout=0)


def test_the_keeper_asks_the_store_once_half_the_lease_passed_and_keeps_rows_past_the_first_deadline():
    async def go():
        clock = FakeClock()
        store = CountingStore(capacity=8, clock=clock)
        meta = await _leased(store)
        keeper = LeaseKeeper(store, meta, 10.0, clock=clock)
        for _ in range(10):  # a turn every 0.4 s: asking each time would be 10 calls
            clock.advance(0.4)
            assert await keeper.renew()
        assert store.renew_calls == 0
        clock.advance(1.0)  # 5 s since the grant
        assert keeper.due and await keeper.renew()
        assert store.renew_calls == 1 and keeper.deadline == pytest.approx(15.0)
        clock.advance(6.0)  # 11 s: past the first deadline
        assert await keeper.renew() and store.renew_calls == 2
        with pytest.raises(StoreTimeoutError):
            await store.get_meta("roll", ["p"], 1, timeout=0)  # still held
        await store.ack(meta)
        await store.close()

    asyncio.run(go())


def test_episodes_sharing_a_lease_share_one_renewal_and_a_lost_lease_stops_them():
    async def go():
        clock = FakeClock()
        store = CountingStore(capacity=8, clock=clock)
        meta = await _leased(store)
        keeper = LeaseKeeper(store, meta, 10.0, clock=clock)
        clock.advance(6.0)
        assert await asyncio.gather(*(keeper.renew() for _ in range(4))) == [True] * 4
        assert store.renew_calls == 1
        await store.release(meta)  # someone else finished it (here: released): the next renewal says so
        clock.advance(5.0)
        assert await keeper.renew() is False and keeper.live is False
        clock.advance(50.0)
        assert await keeper.renew() is False and store.renew_calls == 2  # never asks again
        await store.close()

    asyncio.run(go())


def test_the_keeper_asks_a_store_without_renewal_once_and_logs_it(caplog):
    class NoRenewal(InProcessStore):
        async def renew(self, meta, *, lease_s=None):
            raise UnsupportedFeatureError("no renewal here")

    async def go():
        clock = FakeClock()
        store = NoRenewal(capacity=8, clock=clock)
        meta = await _leased(store)
        keeper = LeaseKeeper(store, meta, 10.0, clock=clock)
        clock.advance(6.0)
        assert await keeper.renew() is True and keeper.supported is False and not keeper.due
        await store.close()

    with caplog.at_level("WARNING", logger="asyncflow.store"):
        asyncio.run(go())
    assert sum("cannot renew leases" in r.getMessage() for r in caplog.records) == 1


def test_the_keeper_refuses_a_put_meta_and_a_bad_lease_s():
    store = InProcessStore(capacity=8)
    with pytest.raises(InvalidRequestError, match="not put"):
        LeaseKeeper(store, BatchMeta(row_ids=torch.tensor([0])), 10.0)
    with pytest.raises(InvalidRequestError, match="lease_s must be positive"):
        LeaseKeeper(store, BatchMeta(row_ids=torch.tensor([0]), lease_id=1), 0.0)


def test_the_blocking_facade_renews_too():
    clock = FakeClock()
    with SyncStore(InProcessStore(capacity=8, clock=clock)) as sync:
        sync.register_task("gen", produces=["p"])
        sync.register_task("roll", consumes=["p"])
        sync.put({"p": _ragged(1)})
        meta = sync.get_meta("roll", ["p"], 1, lease_s=10.0, timeout=0)
        clock.advance(9.0)
        assert sync.renew(meta, lease_s=20.0) == pytest.approx(29.0)
        sync.ack(meta)
        assert sync.renew(meta) is None
