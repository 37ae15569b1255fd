"""The store's trusted internal paths give what the checked, general ones give.

The fifth pass on the in-process store's per-call cost (docs/performance.md, "Per-call fixed cost") added
paths that skip work the store has already done: ``RaggedTensor._trusted`` / ``Batch._trusted`` for what a
read built itself, ``Controller.mark_new_ready`` for the rows ``add_rows`` just made, table slices instead
of gathers for consecutive rows, and a kept storage handle for the "is a view still held" check. Each test
drives a case the shortcut must get right and compares with the general path or the public contract.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

from asyncflow_core.errors import BatchError
from asyncflow_core.interfaces.sampler import Sampler
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store.errors import LeaseError
from asyncflow_core.store.controller import Controller
from asyncflow_core.store.storage import StorageUnit
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.samplers import FifoSampler, GroupSampler, SimilarLengthSampler, TokenBalancedSampler


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


# ---------------------------------------------------------------- a sampler that declares takes_oldest


class _FifoThroughSample(FifoSampler):
    """FIFO's pick through the general path: overriding ``sample`` drops the inherited ``takes_oldest``."""

    def sample(self, candidates, request):
        return super().sample(candidates, request)


class _BalancedThroughSample(TokenBalancedSampler):
    def sample(self, candidates, request):
        return super().sample(candidates, request)


def test_takes_oldest_is_dropped_by_a_subclass_that_picks_anew() -> None:
    assert FifoSampler.takes_oldest and TokenBalancedSampler.takes_oldest
    assert not Sampler.takes_oldest and not GroupSampler.takes_oldest and not SimilarLengthSampler.takes_oldest
    assert not _FifoThroughSample.takes_oldest and not _BalancedThroughSample.takes_oldest

    class Renamed(FifoSampler):  # same pick: keeps the declaration
        pass

    class Declared(FifoSampler):  # a new pick that declares it anyway
        takes_oldest = True

        def sample(self, candidates, request):
            return super().sample(candidates, request)

    class Newest:
        def sample(self, candidates, request):
            return torch.arange(len(candidates) - 1, -1, -1)[: request.batch_size]

    class Mixed(Newest, FifoSampler):  # the pick comes from a base before FifoSampler in the MRO
        pass

    class MixedSub(Renamed):
        pass

    assert Renamed.takes_oldest and Declared.takes_oldest and MixedSub.takes_oldest
    assert Mixed.sample is Newest.sample and not Mixed.takes_oldest


def _meta_fields(meta) -> dict | None:
    if meta is None:
        return None
    out = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        out[f.name] = v.tolist() if isinstance(v, torch.Tensor) else v
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pair", [(FifoSampler, _FifoThroughSample), (TokenBalancedSampler, _BalancedThroughSample)])
def test_lease_of_the_oldest_equals_the_general_path(seed, pair) -> None:
    """Random puts, writes, leases (full, partial, version and partition filters, a candidate window smaller than
    the eligible rows), acks, releases and stream ends: a controller whose sampler declares ``takes_oldest``
    grants what the same sampler through ``sample`` grants, and ends in the same state."""
    rng = np.random.default_rng(seed)
    fast_smp, slow_smp = pair[0](), pair[1]()
    ctls = []
    for _ in range(2):
        c = Controller(4096, default_lease_s=10.0, max_candidates=8)
        c.register_task("gen", produces=["p", "q"])
        c.register_task("train", consumes=["p"])
        c.register_task("both", consumes=["p", "q"])
        ctls.append(c)
    fast, slow = ctls

    def no_candidates(s):  # the declared path never builds them (one rank)
        raise AssertionError("takes_oldest: the one-rank lease built candidates")

    fast._candidates = no_candidates
    leases: list[tuple[int, int]] = []
    fast_hits = remainders = ends = 0
    for step in range(160):
        now = step / 8  # leases of 10 s: some expire
        assert fast.expire(now) == slow.expire(now)
        op = rng.integers(0, 10)
        if op <= 2 and not fast.stream_ended("a"):
            n = int(rng.integers(1, 7))
            part = "a" if rng.random() < 0.7 else "b"
            if part == "b" and fast.stream_ended("b"):
                continue
            groups = rng.integers(0, 4, n) if rng.random() < 0.5 else None
            ids = [c.add_rows(n, part, None if groups is None else torch.from_numpy(groups)) for c in ctls]
            assert ids[0].tolist() == ids[1].tolist()
            cols = ["p"] if rng.random() < 0.6 else ["p", "q"]
            v = torch.from_numpy(rng.integers(0, 5, n)) if rng.random() < 0.5 else None
            if rng.random() < 0.8:
                fast.mark_new_ready(ids[0], cols, v)
                slow.mark_new_ready(ids[1], cols, v)
        elif op == 3 and fast.num_live:
            alive = fast.state_dict()["row_ids"]
            pick = alive[torch.from_numpy(rng.random(alive.numel()) < 0.3)]
            for c in ctls:
                c.mark_ready(pick, ["q"])
        elif op <= 7:
            task, cols = ("train", ("p",)) if rng.random() < 0.6 else ("both", ("p", "q"))
            bs = int(rng.integers(1, 9))
            partial = bool(rng.random() < 0.3)
            minv = int(rng.integers(0, 4)) if rng.random() < 0.3 else None
            part = None if rng.random() < 0.6 else str(rng.choice(["a", "b", "c"]))
            got = [c.try_lease(task, cols, bs, smp, minv, part, partial, None, "w", 0, 1, now)
                   for c, smp in ((fast, fast_smp), (slow, slow_smp))]
            assert _meta_fields(got[0]) == _meta_fields(got[1]), (step, task, bs, partial, minv, part)
            if got[0] is not None and got[0].lease_id is not None:
                leases.append((got[0].lease_id, got[0].lease_id))
                fast_hits += 1
        elif op == 8 and leases:
            lid, _ = leases.pop(int(rng.integers(0, len(leases))))
            outcome, acks = [], rng.random() < 0.7
            for c in ctls:
                try:
                    if acks:
                        outcome.append(c.ack_and_collect(lid, now)[1].tolist())
                    else:
                        outcome.append(c.release(lid))
                except LeaseError as exc:  # expired meanwhile: both must say so
                    outcome.append(type(exc))
            assert outcome[0] == outcome[1]
        elif op == 9 and step > 100:
            part = str(rng.choice(["a", "b"])) if rng.random() < 0.7 else None
            for c in ctls:
                c.end_stream(part)
        _same_state(fast, slow)
    # the end: every partition ends, then each task drains with full-size requests (the remainder is handed
    # out once nothing else can arrive) until its end of stream
    assert fast.expire(100.0) == slow.expire(100.0)  # every lease still out
    for c in ctls:
        c.end_stream()
        c.mark_ready(torch.from_numpy(c._row_id_np[np.flatnonzero(c._alive_np[: c._n])]), ["p", "q"])
    for task, cols in (("train", ("p",)), ("both", ("p", "q"))):
        for i in range(40):
            now = 100.0 + i
            got = [c.try_lease(task, cols, 5, smp, None, None, False, None, "w", 0, 1, now)
                   for c, smp in ((fast, fast_smp), (slow, slow_smp))]
            assert _meta_fields(got[0]) == _meta_fields(got[1]), (task, i)
            if got[0] is None or got[0].end_of_stream:
                ends += got[0] is not None
                break
            remainders += len(got[0]) < 5
            assert fast.ack_and_collect(got[0].lease_id, now)[1].tolist() == \
                slow.ack_and_collect(got[1].lease_id, now)[1].tolist()
            _same_state(fast, slow)
    # the declared path granted leases, handed out a remainder and answered the end of the stream
    assert fast_hits > 5 and remainders and ends


def _same_state(a: Controller, b: Controller) -> None:
    assert _state(a) == _state(b)
    assert {k: v.tolist() for k, v in a.state_dict()["task_state"].items()} == \
        {k: v.tolist() for k, v in b.state_dict()["task_state"].items()}


def test_dp_requests_still_ask_the_sampler() -> None:
    """``takes_oldest`` covers one rank only: a DP split is the sampler's (contiguous chunks for FIFO)."""
    c = Controller(64, default_lease_s=10.0)
    c.register_task("gen", produces=["p"])
    c.register_task("train", consumes=["p"])
    c.mark_new_ready(c.add_rows(6), ["p"])
    a = c.try_lease("train", ("p",), 6, FifoSampler(), None, None, False, None, None, 0, 2, 0.0)
    b = c.try_lease("train", ("p",), 6, FifoSampler(), None, None, False, None, None, 1, 2, 0.0)
    assert a.row_ids.tolist() == [0, 1, 2] and b.row_ids.tolist() == [3, 4, 5]


def test_batch_meta_trusted_builds_what_the_constructor_builds() -> None:
    t = torch.tensor([3, 4])
    full = dict(row_ids=t, columns=("x",), task="train", lease_id=7, deadline=2.5, group_ids=t, min_version=t,
                max_version=t, num_tokens=t, end_of_stream=True, extra={"consumer": "w"})
    assert set(full) == {f.name for f in dataclasses.fields(BatchMeta)}  # every field is covered here
    for kwargs in (full, {"row_ids": t, "columns": ("x",), "extra": {"partition": "default"}}, {"row_ids": t}):
        fast, slow = BatchMeta._trusted(**kwargs), BatchMeta(**kwargs)
        assert fast == slow and repr(fast) == repr(slow) and fast.extra == slow.extra
        assert vars(fast).keys() == vars(slow).keys()
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.task = "other"  # type: ignore[misc]
    a, b = BatchMeta._trusted(row_ids=t), BatchMeta._trusted(row_ids=t)
    a.extra["k"] = 1
    assert b.extra == {}  # each gets its own extra dict, as with the field's default factory


def test_count_nonzero_without_the_wrapper_counts_what_numpy_counts() -> None:
    from asyncflow_core.store.indexing import count_nonzero

    rng = np.random.default_rng(0)
    ints = rng.integers(-2, 3, 1000)
    for a in (ints, ints > 0, ints[::3], ints[1:] <= ints[:-1], np.empty(0, dtype=bool), ints.reshape(10, 100)):
        assert count_nonzero(a) == np.count_nonzero(a) and type(count_nonzero(a)) is type(np.count_nonzero(a))
