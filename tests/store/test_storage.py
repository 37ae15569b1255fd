"""StorageUnit: dense and packed ragged columns, any-order reads, overwrites, frees, schema checks, checkpoint."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.store import StorageUnit
from asyncflow_core.store.errors import ColumnTypeError, InvalidRequestError, UnknownColumnError, UnknownRowError
from asyncflow_core.types import RaggedTensor


def rag(seqs, dtype=torch.int64):
    return RaggedTensor.from_sequences([torch.tensor(s, dtype=dtype) for s in seqs], dtype=dtype)


def test_round_trip_any_order():
    s = StorageUnit()
    s.write([10, 11, 12], {"ids": rag([[1, 2], [], [3, 4, 5]]), "r": torch.tensor([1.0, 2.0, 3.0]),
                           "h": torch.ones(3, 2, dtype=torch.float16)})
    b = s.read([12, 10], ["ids", "r", "h"])
    assert b.row_ids.tolist() == [12, 10]
    assert b["ids"].to_list() == [[3, 4, 5], [1, 2]] and b["r"].tolist() == [3.0, 1.0]
    assert b["h"].shape == (2, 2) and b["h"].dtype == torch.float16
    assert s.lengths([10, 11, 12, 99], "ids").tolist() == [2, 0, 3, 0]
    assert s.nbytes == 5 * 8 + 3 * 4 + 3 * 2 * 2


def test_schema_and_row_checks_reject_without_writing():
    s = StorageUnit()
    s.write([0], {"ids": rag([[1]]), "r": torch.tensor([1.0])})
    before = s.nbytes
    with pytest.raises(ColumnTypeError, match="first written as ragged int64"):
        s.write([1], {"ids": rag([[1.0]], torch.float32)})
    with pytest.raises(ColumnTypeError):
        s.write([1], {"ids": torch.tensor([1])})
    with pytest.raises(ColumnTypeError):
        s.write([1], {"r": torch.ones(1, 3)})
    with pytest.raises(ColumnTypeError, match="holds 2 rows"):
        s.write([1], {"ok": torch.tensor([1.0, 2.0])})
    with pytest.raises(InvalidRequestError):
        s.write([1, 1], {"r": torch.tensor([1.0, 2.0])})
    with pytest.raises(UnknownRowError):
        s.read([5], ["r"])
    with pytest.raises(UnknownColumnError):
        s.read([0], ["nope"])
    assert s.nbytes == before and s.num_rows == 1 and "ok" not in s.schema


def test_missing_value_for_row_is_reported():
    s = StorageUnit()
    s.write([0, 1], {"a": torch.tensor([1, 2])})
    s.write([1], {"b": torch.tensor([3])})
    with pytest.raises(UnknownColumnError, match=r"rows \[0\] have no value for column 'b'"):
        s.read([0, 1], ["b"])


def test_free_reclaims_and_table_reanchors():
    s = StorageUnit()
    for start in range(0, 20000, 1000):
        ids = torch.arange(start, start + 1000)
        s.write(ids, {"ids": rag([[i] * (i % 7) for i in ids.tolist()])})
        if start >= 2000:
            s.free(torch.arange(start - 2000, start - 1000))
    live = torch.arange(18000, 20000)
    assert s.num_rows == 2000
    assert s.read(live[::97], ["ids"])["ids"].to_list() == [[i] * (i % 7) for i in live[::97].tolist()]
    assert s.allocated_nbytes < 1_000_000  # garbage was compacted, not kept


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "free"]), st.lists(st.integers(0, 40), min_size=1, max_size=8,
                                                                          unique=True), st.integers(0, 5)),
                max_size=25))
def test_matches_a_dict_model(ops):
    """Writes, overwrites and frees in any order: reads always equal a plain dict model."""
    s = StorageUnit()
    model: dict[int, list[int]] = {}
    for op, ids, k in ops:
        if op == "write":
            seqs = [[i + k] * ((i + k) % 5) for i in ids]
            s.write(ids, {"x": rag(seqs), "d": torch.tensor([float(i + k) for i in ids])})
            model.update(zip(ids, seqs, strict=True))
        else:
            s.free(ids)
            for i in ids:
                model.pop(i, None)
        if model:
            keys = sorted(model, reverse=True)
            b = s.read(keys, ["x", "d"])
            assert b["x"].to_list() == [model[i] for i in keys]
    assert s.num_rows == len(model)


def test_state_dict_round_trip():
    s = StorageUnit()
    s.write([3, 4], {"ids": rag([[1], [2, 3]]), "r": torch.tensor([0.5, 0.25])})
    s.write([4], {"x": torch.tensor([[1, 2]])})
    t = StorageUnit()
    t.load_state_dict(s.state_dict())
    b = t.read([4, 3], ["ids", "r"])
    assert b["ids"].to_list() == [[2, 3], [1]] and b["r"].tolist() == [0.25, 0.5]
    assert t.read([4], ["x"])["x"].tolist() == [[1, 2]]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "write", "free"]),
                          st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True),
                          st.integers(0, 9)), min_size=1, max_size=30))
def test_long_rows_survive_compaction_in_place(ops):
    """Rows long enough that writes, reads and compaction take the single-memcpy (numpy) paths, and garbage
    that forces the arena to pack itself in place: reads always equal a plain dict model."""
    s = StorageUnit()
    model: dict[int, torch.Tensor] = {}
    for op, ids, k in ops:
        if op == "write":
            seqs = [torch.arange(3000 * (1 + (i + k) % 9), dtype=torch.int64) * (i + 1) + k for i in ids]
            s.write(ids, {"x": RaggedTensor.from_sequences(seqs, dtype=torch.int64),
                          "f": RaggedTensor.from_sequences([q.to(torch.float32) / 7 for q in seqs])})
            model.update(zip(ids, seqs, strict=True))
        else:
            s.free(ids)
            for i in ids:
                model.pop(i, None)
        if model:
            keys = sorted(model, reverse=True)
            b = s.read(keys, ["x", "f"])
            for j, key in enumerate(keys):
                assert torch.equal(b["x"][j], model[key])
                assert torch.equal(b["f"][j], model[key].to(torch.float32) / 7)
    assert s.num_rows == len(model)
