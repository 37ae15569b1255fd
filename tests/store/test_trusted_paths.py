"""The store's trusted internal paths give what the checked, general ones give.

The fifth pass on the in-process store's per-call cost (docs/performance.md, "Per-call fixed cost") added
paths that skip work the store has already done: ``RaggedTensor._trusted`` / ``Batch._trusted`` for what a
read built itself, ``Controller.mark_new_ready`` for the rows ``add_rows`` just made, table slices instead
of gathers for consecutive rows, and a kept storage handle for the "is a view still held" check. Each test
drives a case the shortcut must get right and compares with the general path or the public contract.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from asyncflow_core.errors import BatchError
from asyncflow_core.store.controller import Controller
from asyncflow_core.store.storage import StorageUnit
from asyncflow_core.types import Batch, RaggedTensor


def test_trusted_constructors_build_what_the_checked_ones_build() -> None:
    values, offsets = torch.arange(6), torch.tensor([0, 2, 2, 6])
    a, b = RaggedTensor(values, offsets), RaggedTensor._trusted(values, offsets)
    assert a.equal(b) and len(b) == 3 and b.to_list() == [[0, 1], [], [2, 3, 4, 5]]
    with pytest.raises(AttributeError):  # still frozen
        b.values = values  # type: ignore[misc]
    with pytest.raises(BatchError):  # public construction keeps its checks
        RaggedTensor(values, torch.tensor([0, 4, 2, 6]))
    ids = torch.tensor([7, 8, 9])
    batch = Batch._trusted({"x": b}, ids, 3)
    assert batch.num_rows == 3 and batch.columns == ("x",) and batch.row_ids is ids
    assert batch.select([2]).num_rows == 1 and batch.project(["x"])["x"].equal(b)
    with pytest.raises(BatchError):
        Batch({"x": b}, row_ids=torch.tensor([1, 2]))


def _ctl() -> Controller:
    c = Controller(4096, default_lease_s=10.0)
    c.register_task("gen", produces=["p", "q"])
    c.register_task("train", consumes=["p"])
    c.register_task("both", consumes=["p", "q"])
    c.register_task("any", consumes=[])
    return c


def _lease(c: Controller, task: str, columns: tuple[str, ...], n: int, partial: bool = True):
    return c.try_lease(task, columns, n, None, None, None, partial, None, None, 0, 1, 0.0)


def _state(c: Controller) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in c.state_dict().items()
            if k not in ("task_state",)}


@pytest.mark.parametrize("versions", [None, torch.tensor([3, 4, 5]), torch.tensor([[1, 2], [0, 9], [4, 4]])])
def test_mark_new_ready_equals_mark_ready(versions) -> None:
    fast, slow = _ctl(), _ctl()
    for c in (fast, slow):
        old = c.add_rows(2)
        c.mark_ready(old, ["q"])
        for task, cols in (("train", ("p",)), ("both", ("p", "q")), ("any", ())):  # kept eligibility built
            _lease(c, task, cols, 1)
    ids_f, ids_s = fast.add_rows(3), slow.add_rows(3)
    fast.mark_new_ready(ids_f, ["p"], versions, np.array([5, 6, 7]))
    slow.mark_ready(ids_s, ["p"], versions, torch.tensor([5, 6, 7]))
    assert _state(fast) == _state(slow)
    got = {}
    for task, cols in (("train", ("p",)), ("both", ("p", "q")), ("any", ())):
        a, b = _lease(fast, task, cols, 10), _lease(slow, task, cols, 10)
        got[task] = None if a is None else a.row_ids.tolist()
        assert (b is None) == (a is None), task
        if a is not None:
            assert a.row_ids.tolist() == b.row_ids.tolist(), task
            assert a.min_version.tolist() == b.min_version.tolist() and a.num_tokens.tolist() == b.num_tokens.tolist()
    assert got == {"train": [2, 3, 4], "both": None, "any": [1, 2, 3, 4]}


def test_mark_new_ready_takes_the_general_path_once_the_rows_changed() -> None:
    c = _ctl()
    ids = c.add_rows(4)
    held = _lease(c, "any", (), 2)  # needs no column: leases two of the new rows before they are ready
    assert held.row_ids.tolist() == [0, 1]
    c.mark_new_ready(ids, ["p", "q"])
    again = _lease(c, "any", (), 10)
    assert again.row_ids.tolist() == [2, 3]  # the leased rows stay leased (not made eligible again)
    ids2 = c.add_rows(2)
    c.mark_ready(ids2, ["q"])  # a first write through the general path...
    c.mark_new_ready(ids2, ["p"])  # ...so this one must keep q ready beside p
    both = _lease(c, "both", ("p", "q"), 10)
    assert both.row_ids.tolist() == [0, 1, 2, 3, 4, 5]
    other = torch.tensor([4, 5])  # not the tensor add_rows returned: the general path, same outcome
    c.mark_new_ready(other, ["p"], torch.tensor([1, 1]))
    assert c.live_mask(other).all()


def _ragged(lengths: list[int], start: int = 0) -> RaggedTensor:
    return RaggedTensor.from_lengths(torch.arange(start, start + sum(lengths)), lengths)


def test_storage_slices_and_gathers_agree() -> None:
    unit = StorageUnit()
    unit.write(torch.arange(0, 6), {"x": _ragged([1, 2, 0, 3, 1, 2]), "d": torch.arange(6) * 10})
    unit.write(torch.tensor([2, 3]), {"x": _ragged([4, 1], 100)})  # consecutive rows written again
    unit.write(torch.tensor([5, 1]), {"x": _ragged([1, 1], 200)})  # not consecutive
    want = {0: [0], 1: [201], 2: [100, 101, 102, 103], 3: [104], 4: [6], 5: [200]}
    for ids in ([0, 1, 2, 3, 4, 5], [2, 3, 4], [5, 3, 1], [4], [1, 2, 4]):
        got = unit.read(torch.tensor(ids), ["x", "d"], views=True)
        assert got["x"].to_list() == [want[i] for i in ids], ids
        assert got["d"].tolist() == [10 * i for i in ids] and got.row_ids.tolist() == ids
    unit.free(torch.tensor([1, 2, 3]))  # consecutive: the slice path
    assert unit.num_rows == 3 and unit.lengths(torch.arange(6), "x").tolist() == [1, 0, 0, 0, 1, 1]
    with pytest.raises(Exception, match="hold no data"):
        unit.read(torch.tensor([0, 1]), ["x"])
    unit.free(torch.tensor([0, 1, 4, 5]))  # 1 is gone already: ignored
    assert unit.num_rows == 0


def test_a_held_view_keeps_its_values_until_it_is_dropped() -> None:
    unit = StorageUnit()
    unit.write(torch.arange(3), {"x": _ragged([2, 2, 2])})
    view = unit.read(torch.arange(3), ["x"], views=True)["x"]
    assert view.values.data_ptr() == unit._cols["x"].values.data_ptr()  # a view of the arena
    unit.free(torch.arange(3))
    unit.write(torch.arange(3, 6), {"x": _ragged([2, 2, 2], 50)})  # the arena is seen: written elsewhere
    assert view.to_list() == [[0, 1], [2, 3], [4, 5]]
    del view
    gc.collect()
    unit.free(torch.arange(3, 6))  # nothing live and no view: the arena starts over
    store = unit._cols["x"]
    assert store.used == 0 and not store.in_use()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_read_in_any_order_come_back_whole(dtype) -> None:
    unit = StorageUnit()
    lengths = [40, 0, 50, 33, 64, 45]
    col = RaggedTensor.from_lengths(torch.arange(sum(lengths)).to(dtype), lengths)
    unit.write(torch.arange(6), {"x": col})
    unit.write(torch.tensor([3]), {"x": RaggedTensor.from_lengths(torch.full((70,), -1.0, dtype=dtype), [70])})
    rows = {i: col[i].tolist() for i in range(6)}
    rows[3] = [-1.0] * 70
    for ids in ([5, 0, 2], [0, 1, 2, 4, 5], [4, 3, 1, 0], [2, 3]):  # runs of touching rows, an empty row, gaps
        got = unit.read(torch.tensor(ids), ["x"])["x"]
        assert got.dtype == dtype and got.to_list() == [rows[i] for i in ids], ids


def test_from_lengths_and_cat_keep_their_checks() -> None:
    a = RaggedTensor.from_lengths(torch.arange(5), [2, 3])
    b = RaggedTensor.from_lengths(torch.arange(5, 6), torch.tensor([0, 1]))
    assert RaggedTensor.cat([a, b]).to_list() == [[0, 1], [2, 3, 4], [], [5]]
    assert RaggedTensor.cat([a[1:], b]).offsets.tolist() == [0, 3, 3, 4]  # a part's offsets from a slice
    for bad in ([2, -1, 4], [2, 2]):
        with pytest.raises(BatchError):
            RaggedTensor.from_lengths(torch.arange(5), bad)
    with pytest.raises(BatchError):
        RaggedTensor.from_lengths(torch.tensor(3), [])
    with pytest.raises(BatchError):
        RaggedTensor.from_lengths(torch.arange(4), torch.tensor([[4]]))


@pytest.mark.parametrize("groups", [[5, 5, -1, 6, 5], [100000, 100000, -1, 100001, -1, 100000],
                                    [3, 900000, 3, -1, 900000, 7], [-1, -1], [0, 0, 1]])
def test_candidates_count_each_group_in_any_id_window(groups) -> None:
    c = _ctl()
    ids = c.add_rows(len(groups), group_ids=torch.tensor(groups))
    c.mark_ready(ids, ["p"])
    slots, _ = c._eligible_slots(c._tasks["train"], ("p",), None, None)
    cands = c._candidates(slots)
    want = [groups.count(g) if g >= 0 else 0 for g in groups]
    assert cands.group_ids.tolist() == groups and cands.group_ready.tolist() == want
