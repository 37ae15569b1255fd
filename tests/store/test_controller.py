"""Controller: leasing, readiness, versions, expiry, DP rounds, gc, end of stream, checkpoint, bad input."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.store import Controller
from asyncflow_core.store.errors import (
    InvalidRequestError,
    LeaseError,
    StoreFullError,
    UnknownColumnError,
    UnknownRowError,
)

COLS = ["prompt_ids", "response_ids"]


def plain(x):
    """A state_dict as plain Python values, for equality checks."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x


def make(capacity: int = 100, **kw) -> Controller:
    c = Controller(capacity, **kw)
    c.register_task("rollout", produces=COLS + ["reward"])
    c.register_task("train", consumes=COLS)
    c.register_task("ref", consumes=["prompt_ids"])
    return c


def test_fifo_lease_ack_and_gc():
    c = make()
    ids = c.add_rows(5)
    c.mark_ready(ids, COLS)
    m = c.try_lease("train", COLS, 3, "fifo", now=0.0)
    assert m.row_ids.tolist() == [0, 1, 2] and m.deadline == 600.0
    assert c.ack(m.lease_id, now=1.0) == 3
    assert c.gc(m.row_ids).numel() == 0  # "ref" has not consumed them yet
    r = c.try_lease("ref", ["prompt_ids"], 5, "fifo", now=0.0)
    c.ack(r.lease_id)
    assert c.gc(r.row_ids).tolist() == [0, 1, 2]
    assert c.num_live == 2


def test_not_ready_rows_wait_and_partial():
    c = make()
    ids = c.add_rows(3)
    c.mark_ready(ids[:2], ["prompt_ids"])
    assert c.try_lease("train", COLS, 1, "fifo") is None
    c.mark_ready(ids[1:], COLS)
    assert c.try_lease("train", COLS, 3, "fifo") is None
    assert c.try_lease("train", COLS, 3, "fifo", partial=True).row_ids.tolist() == [1, 2]


def test_versions_widen_and_filter():
    c = make()
    ids = c.add_rows(3)
    c.mark_ready(ids, ["prompt_ids"], versions=torch.tensor([[3, 3], [1, 2], [5, 6]]))
    c.mark_ready(ids[:1], ["response_ids"], versions=torch.tensor([2]))
    c.mark_ready(ids[1:], ["response_ids"])
    m = c.try_lease("train", COLS, 3, "fifo", min_version=2, partial=True)
    assert m.row_ids.tolist() == [0, 2]
    assert m.min_version.tolist() == [2, 5] and m.max_version.tolist() == [3, 6]


def test_expiry_and_next_deadline():
    c = make()
    c.mark_ready(c.add_rows(2), COLS)
    a = c.try_lease("train", COLS, 1, "fifo", lease_s=5, now=0.0)
    c.try_lease("train", COLS, 1, "fifo", lease_s=9, now=0.0)
    assert c.next_deadline() == 5.0
    expired, nxt = c.expire(5.0)
    assert expired == [a.lease_id] and nxt == 9.0
    with pytest.raises(LeaseError, match="already expired"):
        c.ack(a.lease_id)
    again = c.try_lease("train", COLS, 1, "fifo", now=5.0)
    assert again.row_ids.tolist() == a.row_ids.tolist()
    with pytest.raises(LeaseError, match="deadline passed"):
        c.ack(again.lease_id, now=1000.0)


def test_declare_dead_frees_only_that_consumer():
    c = make()
    c.mark_ready(c.add_rows(4), COLS)
    c.try_lease("train", COLS, 2, "fifo", consumer="a")
    b = c.try_lease("train", COLS, 2, "fifo", consumer="b")
    assert c.declare_dead("a") == 2
    assert c.stats()["rows_leased"] == 2
    assert c.ack(b.lease_id) == 2


def test_dp_round_is_shared_and_disjoint():
    c = make()
    ids = c.add_rows(8)
    c.mark_ready(ids, COLS, num_tokens=[1, 2, 3, 4, 5, 6, 7, 8])
    parts = {r: c.try_lease("train", COLS, 8, "token_balanced", dp_rank=r, dp_size=2, consumer=f"r{r}") for r in (1, 0)}
    assert set(parts[0].row_ids.tolist()) | set(parts[1].row_ids.tolist()) == set(range(8))
    assert int(parts[0].num_tokens.sum()) == int(parts[1].num_tokens.sum()) == 18
    assert parts[0].extra["consumer"] == "r0"
    # a second round for rank 0 waits for rows (none left), it does not steal rank 1's
    assert c.try_lease("train", COLS, 8, "token_balanced", dp_rank=0, dp_size=2) is None


def test_unclaimed_dp_part_expires_back_to_free():
    c = make()
    c.mark_ready(c.add_rows(4), COLS)
    mine = c.try_lease("train", COLS, 4, "fifo", dp_rank=0, dp_size=2, lease_s=5, now=0.0)
    assert mine.row_ids.tolist() == [0, 1]
    c.expire(6.0)
    assert c.try_lease("train", COLS, 4, "fifo", dp_rank=1, dp_size=2, now=6.0).row_ids.tolist() == [2, 3]


def test_end_of_stream_per_request():
    c = make()
    ids = c.add_rows(3, partition="p0")
    c.mark_ready(ids, COLS)
    c.end_stream("p0")
    with pytest.raises(InvalidRequestError):
        c.add_rows(1, partition="p0")
    last = c.try_lease("train", COLS, 5, "fifo", partition="p0")
    assert len(last) == 3 and not last.end_of_stream  # the short remainder, then the end
    assert c.try_lease("train", COLS, 5, "fifo", partition="p0") is None  # leased rows may come back
    c.ack(last.lease_id)
    assert c.try_lease("train", COLS, 5, "fifo", partition="p0").end_of_stream
    assert c.is_end_of_stream("train", COLS, partition="p0")
    assert not c.is_end_of_stream("ref", ["prompt_ids"], partition="p0")
    c.add_rows(1, partition="p1")  # other partitions still open
    assert not c.stream_ended(None)


def test_capacity_and_bad_requests_leave_state_unchanged():
    c = make(capacity=4)
    c.mark_ready(c.add_rows(3), COLS)
    before = plain(c.state_dict())
    with pytest.raises(StoreFullError):
        c.add_rows(2)
    with pytest.raises(InvalidRequestError):
        c.add_rows(5)
    with pytest.raises(InvalidRequestError):
        c.add_rows(1, group_ids=[1, 2])
    with pytest.raises(InvalidRequestError):
        c.try_lease("train", COLS, 0, "fifo")
    with pytest.raises(InvalidRequestError):
        c.try_lease("train", COLS, 5, "fifo")
    with pytest.raises(InvalidRequestError):
        c.try_lease("nobody", COLS, 1, "fifo")
    with pytest.raises(UnknownColumnError):
        c.try_lease("train", ["nope"], 1, "fifo")
    with pytest.raises(InvalidRequestError):
        c.try_lease("train", COLS, 1, "fifo", dp_rank=2, dp_size=2)
    with pytest.raises(UnknownRowError):
        c.mark_ready([0, 99], COLS)
    with pytest.raises(InvalidRequestError):
        c.mark_ready([0, 1], COLS, versions=torch.tensor([[2, 1], [0, 0]]))
    with pytest.raises(LeaseError):
        c.ack(12345)
    assert plain(c.state_dict()) == before


def test_checkpoint_round_trip_and_pickling():
    c = make()
    c.mark_ready(c.add_rows(4, group_ids=[0, 0, 1, 1]), COLS, versions=torch.arange(4))
    done = c.try_lease("train", COLS, 2, "fifo")
    c.ack(done.lease_id)
    c.try_lease("train", COLS, 1, "fifo")  # outstanding: comes back free
    state = pickle.loads(pickle.dumps(c.state_dict()))
    c2 = Controller(100)
    c2.load_state_dict(state)
    m = c2.try_lease("train", COLS, 4, "fifo", partial=True)
    assert m.row_ids.tolist() == [2, 3] and m.group_ids.tolist() == [1, 1] and m.min_version.tolist() == [2, 3]
    assert c2.add_rows(1).tolist() == [4]
    assert m.lease_id > done.lease_id
    assert pickle.loads(pickle.dumps(m)).row_ids.tolist() == [2, 3]


def test_clear_and_compaction_keep_lookups_right():
    c = make(capacity=5000)
    ids = c.add_rows(3000, partition="a")
    c.mark_ready(ids, COLS)
    for task, cols in (("train", COLS), ("ref", ["prompt_ids"])):
        m = c.try_lease(task, cols, 2000, "fifo")
        c.ack(m.lease_id)
    assert c.gc().numel() == 2000  # triggers compaction
    more = c.add_rows(10, partition="b")
    c.mark_ready(more, COLS)
    m = c.try_lease("train", COLS, 1010, "fifo")
    assert m.row_ids.tolist() == list(range(2000, 3010))
    assert c.clear("a").numel() == 1000
    with pytest.raises(UnknownRowError):
        c.check_rows([2500])
    c.check_rows([3005])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=12), st.integers(1, 6))
def test_every_row_leased_exactly_once(ops, batch):
    """Random puts and leases: every row is handed out at most once per task, and all of them in the end."""
    c = make(capacity=1000)
    seen: list[int] = []
    for n, lease in ops:
        c.mark_ready(c.add_rows(n), COLS)
        if lease:
            m = c.try_lease("train", COLS, batch, "fifo", partial=True)
            seen += m.row_ids.tolist()
            c.ack(m.lease_id)
    c.end_stream()
    while not (m := c.try_lease("train", COLS, batch, "fifo")).end_of_stream:
        seen += m.row_ids.tolist()
        c.ack(m.lease_id)
    assert sorted(seen) == list(range(sum(n for n, _ in ops)))
