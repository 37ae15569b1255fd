"""collect_update / ModelTensors: the checks every rollout engine applies to an update before any of it is used."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.types import ModelTensors, collect_update, pack_buckets


def _model() -> dict[str, torch.Tensor]:
    emb = torch.randn(8, 4)
    return {"embed.weight": emb, "layer.weight": torch.randn(4, 4), "layer.bias": torch.zeros(4),
            "head.weight": emb}  # tied to the embedding


def _feed(buckets):
    async def gen():
        for b in buckets:
            yield b

    return gen()


def _collect(version, buckets, model):
    return asyncio.run(collect_update(version, _feed(buckets), model=model))


def _packed(named, version=1, bucket_bytes=64):
    return list(pack_buckets(list(named.items()), version=version, bucket_bytes=bucket_bytes))


def test_of_finds_tied_groups_by_identity():
    model = ModelTensors.of(_model())
    assert model.tied_groups == [["embed.weight", "head.weight"]]
    assert model.missing(["embed.weight", "layer.weight", "layer.bias"]) == []
    assert model.missing(["head.weight", "layer.weight"]) == ["layer.bias"]
    assert model.missing(["layer.weight", "layer.bias"]) == ["embed.weight", "head.weight"]


def test_a_complete_update_comes_back_in_order():
    named = {k: v.clone() for k, v in _model().items() if k != "head.weight"}
    buckets = _packed(named)
    assert len(buckets) > 1
    out = _collect(1, buckets, ModelTensors.of(_model()))
    assert [b.index for b in out] == list(range(len(buckets)))
    got = {n: t for b in out for n, t in b.tensors()}
    assert all(torch.equal(got[n], named[n]) for n in named)


@pytest.mark.parametrize("case, message", [
    ("unknown", "'nope.weight' is not a tensor of this model"),
    ("shape", "layer.weight: shape (3, 4) does not match the model's (4, 4)"),
    ("dtype", "layer.bias: dtype float64 does not match the model's float32"),
    ("missing", "left 1 of the model's tensors unset, e.g. ['layer.bias']"),
    ("twice", "'layer.bias' was sent twice"),
    ("version", "bucket 0 belongs to version 2, not to the update to version 1"),
    ("empty", "carried no weight buckets"),
    ("truncated", "ended before its last bucket"),
    ("corrupt", "corrupted"),
])
def test_each_bad_update_is_refused_with_its_reason(case, message):
    base = {k: v for k, v in _model().items() if k != "head.weight"}
    named = dict(base)
    version = 1
    if case == "unknown":
        named["nope.weight"] = torch.zeros(2)
    elif case == "shape":
        named["layer.weight"] = torch.zeros(3, 4)
    elif case == "dtype":
        named["layer.bias"] = torch.zeros(4, dtype=torch.float64)
    elif case == "missing":
        del named["layer.bias"]
    elif case == "version":
        version = 2
    buckets = [] if case == "empty" else _packed(named, version=version)
    if case == "twice":
        joined = _packed(named) + _packed({"layer.bias": torch.zeros(4)})
        buckets = [type(b)(b.version, i, b.metas, b.buffer, b.checksum, i == len(joined) - 1)
                   for i, b in enumerate(joined)]
    elif case == "truncated":
        buckets = buckets[:-1]
    elif case == "corrupt":
        buckets[0].buffer[0] ^= 0xFF
    with pytest.raises(WeightTransferError) as info:
        _collect(1, buckets, ModelTensors.of(_model()))
    assert message in str(info.value)


def test_without_a_model_only_the_stream_is_checked():
    """An engine that cannot see its model (a remote server) still gets checksum, version, duplicate, last checks."""
    out = _collect(1, _packed({"anything": torch.ones(3)}), None)
    assert [m.name for b in out for m in b.metas] == ["anything"]


def test_a_tied_name_not_in_the_model_is_refused():
    with pytest.raises(ValueError, match="not one of the model's tensors"):
        ModelTensors({"a": ((1,), torch.float32)}, tied=[["a", "b"]])
