"""The one weight digest (xxh3-128 over 8 MiB spans): definition, what it catches, the verified memory."""

import asyncio
import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
import xxhash

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.types import ModelTensors, collect_update, pack_buckets, verify_buckets, weight_digest
from asyncflow_core.types import weights as W
from asyncflow_plugins.weight_transports import manifest


def reference_digest(data: bytes) -> str:
    """The definition in asyncflow_core/types/weights.py, written out independently."""
    span = 8 << 20
    leaves = [xxhash.xxh3_128_digest(data[a : a + span]) for a in range(0, len(data), span)] or [
        xxhash.xxh3_128_digest(b"")]
    return xxhash.xxh3_128_hexdigest(len(data).to_bytes(8, "little") + b"".join(leaves))


@pytest.mark.parametrize("nbytes", [0, 1, 63, (8 << 20) - 1, 8 << 20, (8 << 20) + 1, (17 << 20) + 5])
def test_digest_matches_its_definition_across_span_boundaries(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert weight_digest(torch.from_numpy(data)) == reference_digest(data.tobytes())
    assert len(weight_digest(torch.from_numpy(data))) == 32


def test_every_digest_user_is_the_core_function():
    assert manifest.checksum is W.weight_digest
    assert W.buffer_checksum is W.weight_digest


def test_digest_catches_flips_truncation_and_swapped_spans():
    span = W.DIGEST_SPAN_BYTES
    data = np.random.default_rng(0).integers(0, 256, 2 * span, dtype=np.uint8)
    base = weight_digest(torch.from_numpy(data))
    flipped = data.copy()
    flipped[span + 7] ^= 1
    swapped = np.concatenate([data[span:], data[:span]])
    zero_tail = data.copy()
    zero_tail[-64:] = 0
    for other in (flipped, data[:-1], np.concatenate([data, np.zeros(1, np.uint8)]), swapped, zero_tail):
        assert weight_digest(torch.from_numpy(other)) != base
    # a different dtype view of the same bytes is the same digest (it is over bytes)
    assert weight_digest(torch.from_numpy(data).view(torch.float32)) == base


def test_pack_buckets_packs_non_contiguous_tensors_and_zeroes_padding():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(6, 5, generator=g).t()  # non-contiguous
    items = [("t", t), ("b", torch.tensor([True, False, True])), ("s", torch.tensor(3.5))]
    dirty = torch.full((1 << 10,), 0xAB, dtype=torch.uint8)
    buckets = list(pack_buckets(items, version=1, bucket_bytes=1 << 20, allocate=lambda n: dirty[:n]))
    assert len(buckets) == 1
    got = dict(buckets[0].tensors())
    assert torch.equal(got["t"], t) and torch.equal(got["b"], items[1][1]) and torch.equal(got["s"], items[2][1])
    assert buckets[0].buffer.data_ptr() == dirty.data_ptr()  # exported straight into the given buffer
    m = buckets[0].metas
    assert not buckets[0].buffer[m[0].nbytes : m[1].offset].any()  # padding zeroed, so the digest is reproducible
    clean = next(pack_buckets(items, version=1, bucket_bytes=1 << 20))
    assert clean.checksum == buckets[0].checksum
    with pytest.raises(ValueError, match="1-D uint8"):
        next(pack_buckets(items, version=1, bucket_bytes=1 << 20, allocate=lambda n: torch.empty(n)))


def test_verified_memory_is_per_object_and_invalidated_by_in_place_writes():
    bucket = next(pack_buckets([("w", torch.arange(100, dtype=torch.float32))], version=1, bucket_bytes=1 << 20))
    assert not bucket.verified
    bucket.verify()
    assert bucket.verified
    bucket.buffer[5] ^= 1  # an in-place write through torch: checked again, and caught
    assert not bucket.verified
    with pytest.raises(WeightTransferError, match="corrupted"):
        bucket.verify()
    bucket.buffer[5] ^= 1
    bucket.verify()
    for other in (pickle.loads(pickle.dumps(bucket)), copy.copy(bucket), dataclasses.replace(bucket)):
        assert not other.verified  # a copy (or a bucket that crossed a process) verifies afresh
        other.verify()


def test_collect_update_checks_every_bucket_in_parallel_and_names_the_bad_one():
    items = [(f"w{i}", torch.full((1 << 16,), float(i))) for i in range(6)]
    buckets = list(pack_buckets(items, version=2, bucket_bytes=1 << 18))
    bad = buckets[2].buffer.clone()
    bad[100] ^= 0x10
    broken = [dataclasses.replace(b, buffer=bad) if b.index == 2 else b for b in buckets]

    async def feed(xs):
        for x in xs:
            yield x

    model = ModelTensors.of(dict(items))
    with pytest.raises(WeightTransferError, match="weight bucket 2 of version 2 is corrupted"):
        asyncio.run(collect_update(2, feed(broken), model=model))
    assert len(asyncio.run(collect_update(2, feed(buckets), model=model))) == len(buckets)
    with pytest.raises(WeightTransferError, match="bucket 1 of version 2 is corrupted .here."):
        verify_buckets(buckets, where="here", digests=[b.checksum if b.index != 1 else "0" * 32 for b in buckets])
