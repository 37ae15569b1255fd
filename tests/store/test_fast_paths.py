"""The controller's per-call shortcuts hold what the long way held.

The fixed cost per store call was cut with shortcuts (docs/performance.md, "Streaming store"): numpy views
of the row tables taken once per allocation, a lease's slots remembered from its grant, ``ack_and_collect``
finding an ack's rows once, compaction that moves the kept eligibility with its rows. Each test here drives
the state a shortcut must notice (a table reallocated, slots moved under a lease) and checks the outcome
through the public methods.
"""

from __future__ import annotations

import torch

from asyncflow_core.store.controller import Controller


def _ctl(capacity: int = 4096) -> Controller:
    c = Controller(capacity, default_lease_s=10.0)
    c.register_task("gen", produces=["p"])
    c.register_task("train", consumes=["p"])
    return c


def _lease(c: Controller, task: str, columns: tuple[str, ...], n: int, now: float = 0.0, partial: bool = False):
    return c.try_lease(task, columns, n, None, None, None, partial, None, None, 0, 1, now)


def test_tables_grown_after_rows_exist_are_seen_by_every_call() -> None:
    c = _ctl()
    first = c.add_rows(1000)
    c.mark_ready(first, ["p"])
    second = c.add_rows(1500)  # past the first allocation (1024 slots): every table is reallocated
    c.mark_ready(second, ["p"], num_tokens=torch.arange(1500))
    c.register_task("eval", consumes=["p"])  # a task's tables added after rows exist
    many = [f"c{i}" for i in range(70)]  # a second ready word
    c.register_task("gen", produces=many)
    c.register_task("late", consumes=["c69"])
    c.mark_ready(second[:3], ["c69"])
    meta = _lease(c, "train", ("p",), 2500)
    assert meta is not None and meta.row_ids.tolist() == list(range(2500))
    assert meta.num_tokens[1000:].tolist() == list(range(1500))
    late = _lease(c, "late", ("c69",), 3, partial=True)
    assert late is not None and late.row_ids.tolist() == second[:3].tolist()
    ev = _lease(c, "eval", ("p",), 2500)
    assert ev is not None and len(ev) == 2500


def test_an_ack_after_compaction_moved_its_rows_acknowledges_those_rows() -> None:
    c = _ctl()
    ids = c.add_rows(300)
    c.mark_ready(ids, ["p"])
    big = _lease(c, "train", ("p",), 290)
    small = _lease(c, "train", ("p",), 10)
    assert small is not None and small.row_ids.tolist() == list(range(290, 300))
    done, dropped = c.ack_and_collect(big.lease_id, now=1.0)  # 290 dead rows: the table compacts
    assert done == 290 and dropped.tolist() == list(range(290))
    more = c.add_rows(300)  # new rows take the slots after the moved ones, the small lease's old slots too
    c.mark_ready(more, ["p"])
    done, dropped = c.ack_and_collect(small.lease_id, now=1.0)
    assert done == 10 and dropped.tolist() == list(range(290, 300))
    stats = c.stats()
    assert stats["rows_live"] == 300 and stats["rows_leased"] == 0
    rest = _lease(c, "train", ("p",), 300)
    assert rest is not None and rest.row_ids.tolist() == more.tolist()


def test_ack_and_collect_is_ack_then_gc() -> None:
    a, b = _ctl(), _ctl()
    for c in (a, b):
        c.register_task("ref", consumes=["p"])
        ids = c.add_rows(8)
        c.mark_ready(ids, ["p"])
        m = _lease(c, "ref", ("p",), 8)
        c.ack(m.lease_id)
    ma, mb = _lease(a, "train", ("p",), 4), _lease(b, "train", ("p",), 4)
    got = a.ack_and_collect(ma.lease_id)
    want = (b.ack(mb.lease_id), b.gc(mb.row_ids))
    assert got[0] == want[0] == 4 and got[1].tolist() == want[1].tolist() == [0, 1, 2, 3]
    assert a.stats() == b.stats()


def test_a_renewal_to_the_same_deadline_expires_the_lease_once() -> None:
    c = _ctl()
    ids = c.add_rows(2)
    c.mark_ready(ids, ["p"])
    m = c.try_lease("train", ("p",), 1, None, None, None, False, 2.0, None, 0, 1, 0.0)
    assert c.renew(m.lease_id, lease_s=2.0, now=0.0)  # the deadline stays 2.0: a second heap entry for it
    expired, _ = c.expire(3.0)
    assert expired == [m.lease_id]
    assert c.stats()["leases_expired"] == 1
    again = _lease(c, "train", ("p",), 2, now=3.0)
    assert again is not None and again.row_ids.tolist() == [0, 1]
