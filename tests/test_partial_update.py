"""collect_update with a declared partial update (an adapter set): accepted when declared, refused when not.

A tensor silently missing from an update is the bug the full-coverage check
catches; a partial update must say which tensors it carries, and then every
declared tensor must arrive and no other.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.types import ModelTensors, collect_update, pack_buckets

#: a base model with LoRA adapter tensors on its projection (the adapter set is the lora_* names)
ADAPTER = ("layer.lora_A.weight", "layer.lora_B.weight")


def _model() -> dict[str, torch.Tensor]:
    emb = torch.randn(8, 4)
    return {"embed.weight": emb, "layer.weight": torch.randn(4, 4), "layer.bias": torch.zeros(4),
            "layer.lora_A.weight": torch.randn(2, 4), "layer.lora_B.weight": torch.zeros(4, 2),
            "head.weight": emb}  # tied to the embedding


def _collect(version, named, *, model, partial=None, bucket_bytes=64):
    buckets = list(pack_buckets(list(named.items()), version=version, bucket_bytes=bucket_bytes))

    async def feed():
        for b in buckets:
            yield b

    return asyncio.run(collect_update(version, feed(), model=model, partial=partial))


def _adapter(names=ADAPTER) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(_model()[n], 0.5) for n in names}


@pytest.mark.parametrize("with_model", [True, False])
def test_a_declared_adapter_only_update_is_accepted(with_model):
    model = ModelTensors.of(_model()) if with_model else None
    out = _collect(3, _adapter(), model=model, partial=ADAPTER)
    got = {n: t for b in out for n, t in b.tensors()}
    assert set(got) == set(ADAPTER)
    assert all(torch.equal(got[n], _adapter()[n]) for n in ADAPTER)


def test_the_same_update_undeclared_is_refused_naming_what_is_unset():
    with pytest.raises(WeightTransferError, match=r"left 4 of the model's tensors unset.*partial=names") as info:
        _collect(3, _adapter(), model=ModelTensors.of(_model()))
    assert "embed.weight" in str(info.value)


@pytest.mark.parametrize("with_model", [True, False])
def test_a_declared_tensor_that_does_not_arrive_is_refused(with_model):
    """The bug a partial update must not hide: one adapter tensor silently missing."""
    model = ModelTensors.of(_model()) if with_model else None
    with pytest.raises(WeightTransferError,
                       match=r"partial update to version 3 left 1 of its 2 declared tensors unset.*lora_B"):
        _collect(3, _adapter(ADAPTER[:1]), model=model, partial=ADAPTER)


@pytest.mark.parametrize("with_model", [True, False])
def test_a_tensor_outside_the_declaration_is_refused(with_model):
    model = ModelTensors.of(_model()) if with_model else None
    named = {**_adapter(), "layer.bias": torch.ones(4)}
    with pytest.raises(WeightTransferError, match=r"'layer.bias' is not one of the 2 tensors the partial update"):
        _collect(3, named, model=model, partial=ADAPTER)


def test_a_declaration_naming_no_model_tensor_or_nothing_is_refused():
    model = ModelTensors.of(_model())
    with pytest.raises(WeightTransferError, match=r"declares \['layer.lora_C.weight'\], not tensors of this model"):
        _collect(3, _adapter(), model=model, partial=[*ADAPTER, "layer.lora_C.weight"])
    with pytest.raises(WeightTransferError, match="declares no tensors"):
        _collect(3, _adapter(), model=model, partial=[])
    with pytest.raises(TypeError, match="partial takes the names"):
        _collect(3, _adapter(), model=model, partial=True)


def test_a_partial_update_keeps_the_other_checks():
    model = ModelTensors.of(_model())
    bad = {"layer.lora_A.weight": torch.zeros(3, 4), "layer.lora_B.weight": torch.zeros(4, 2)}
    with pytest.raises(WeightTransferError, match=r"layer.lora_A.weight: shape \(3, 4\) does not match"):
        _collect(3, bad, model=model, partial=ADAPTER)
    buckets = list(pack_buckets(list(_adapter().items()), version=3, bucket_bytes=64))

    async def cut():
        for b in buckets[:-1]:
            yield b

    with pytest.raises(WeightTransferError, match="ended before its last bucket"):
        asyncio.run(collect_update(3, cut(), model=model, partial=ADAPTER))


def test_a_tied_declared_name_is_covered_by_its_partner():
    """Declaring both names of a tied pair and sending one sets both (as in a full update)."""
    model = ModelTensors.of(_model())
    out = _collect(3, {"embed.weight": torch.ones(8, 4)}, model=model, partial=["embed.weight", "head.weight"])
    assert [m.name for b in out for m in b.metas] == ["embed.weight"]
