"""Property tests for the packed ragged type: the layout every column and micro-batch uses."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_core.errors import BatchError
from asyncflow_core.types import Batch, RaggedTensor

seqs = st.lists(st.lists(st.integers(-(2**40), 2**40), max_size=12), max_size=20)


def offsets_ok(rt: RaggedTensor) -> bool:
    o = rt.offsets
    return int(o[0]) == 0 and int(o[-1]) == rt.values.shape[0] and bool((o[1:] >= o[:-1]).all())


@given(seqs)
def test_pack_unpack_round_trip(data):
    rt = RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in data], dtype=torch.int64)
    assert rt.to_list() == data
    assert len(rt) == len(data)
    assert rt.lengths.tolist() == [len(s) for s in data]
    assert offsets_ok(rt)


@given(seqs, st.integers(-25, 25), st.integers(-25, 25), st.sampled_from([1, 1, 2, 3, -1]))
def test_slicing_matches_python_lists(data, a, b, step):
    rt = RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in data], dtype=torch.int64)
    part = rt[a:b:step]
    assert part.to_list() == data[a:b:step]
    assert offsets_ok(part)


@given(seqs, st.data())
def test_select_gathers_any_order_with_repeats(data, draw):
    rt = RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in data], dtype=torch.int64)
    if not data:
        return
    index = draw.draw(st.lists(st.integers(0, len(data) - 1), max_size=30))
    picked = rt.select(torch.tensor(index, dtype=torch.int64))
    assert picked.to_list() == [data[i] for i in index]
    assert offsets_ok(picked)


@given(st.lists(seqs, min_size=1, max_size=5))
def test_concatenation_keeps_offsets(parts):
    rts = [RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in p], dtype=torch.int64) for p in parts]
    cat = RaggedTensor.cat(rts)
    assert cat.to_list() == [s for p in parts for s in p]
    assert offsets_ok(cat)


@given(seqs)
def test_padded_round_trip(data):
    rt = RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in data], dtype=torch.int64)
    padded, mask = rt.to_padded(pad_value=-1)
    assert RaggedTensor.from_padded(padded, mask).equal(rt)


def test_trailing_dimensions_survive_select():
    rt = RaggedTensor.from_sequences([torch.ones(2, 3), torch.zeros(0, 3), torch.full((1, 3), 7.0)])
    assert rt.select(torch.tensor([2, 0])).values.tolist() == [[7.0] * 3, [1.0] * 3, [1.0] * 3]


@pytest.mark.parametrize(
    "values, offsets, message",
    [
        (torch.arange(3), torch.tensor([0, 2]), "end at values.shape"),
        (torch.arange(3), torch.tensor([0, 2, 1, 3]), "non-decreasing"),
        (torch.arange(3), torch.tensor([0.0, 3.0]), "int64"),
        (torch.arange(3), torch.tensor([1, 3]), "start at 0"),
    ],
)
def test_inconsistent_parts_are_rejected(values, offsets, message):
    with pytest.raises(BatchError, match=message):
        RaggedTensor(values, offsets)


def test_cat_refuses_mixed_dtypes():
    with pytest.raises(BatchError, match="different dtypes"):
        RaggedTensor.cat([RaggedTensor.from_sequences([[1]]), RaggedTensor.from_sequences([[1.0]])])


@given(seqs, st.data())
def test_batch_select_and_cat_keep_rows_together(data, draw):
    n = len(data)
    rt = RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in data], dtype=torch.int64)
    batch = Batch({"ids": rt, "reward": torch.arange(n, dtype=torch.float32)}, row_ids=torch.arange(100, 100 + n))
    index = draw.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=10)) if n else []
    picked = batch.select(index)
    assert picked["ids"].to_list() == [data[i] for i in index]
    assert picked["reward"].tolist() == [float(i) for i in index]
    assert picked.row_ids.tolist() == [100 + i for i in index]
    both = Batch.cat([batch, picked])
    assert both.num_rows == n + len(index)
    assert both["ids"].to_list() == data + [data[i] for i in index]


def test_batch_rejects_columns_of_different_lengths():
    with pytest.raises(BatchError, match="disagree on the number of rows"):
        Batch({"a": torch.zeros(3), "b": RaggedTensor.from_sequences([[1], [2]])})



def _two_column_batch() -> Batch:
    return Batch({"ids": RaggedTensor.from_sequences([[1, 2], [3]]), "reward": torch.tensor([0.5, 1.0])})


def test_batch_to_its_own_device_is_the_batch_itself():
    batch = _two_column_batch()
    assert batch.to("cpu") is batch and batch.to(torch.device("cpu")) is batch  # no copy


@pytest.mark.gpu
def test_batch_to_moves_every_column_and_its_offsets():
    """A trainer's loss combines the micro-batch with log-probs on the rank's device."""
    batch = _two_column_batch()
    moved = batch.to("cuda")
    assert moved.num_rows == 2 and moved.columns == batch.columns
    assert moved["ids"].values.is_cuda and moved["ids"].offsets.is_cuda and moved["reward"].is_cuda
    assert moved["ids"].to("cpu").equal(batch["ids"])
