"""Weight buckets: packing, views, checksums."""

import dataclasses

import pytest
import torch

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.types import pack_buckets


def named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(10, 10, generator=g)),
        ("b", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(7, dtype=torch.int64)),
        ("big", torch.randn(100, 100, generator=g)),
    ]


def test_buckets_round_trip_and_respect_size():
    buckets = list(pack_buckets(named(), version=5, bucket_bytes=1024))
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert buckets[-1].last and not any(b.last for b in buckets[:-1])
    for b in buckets:
        b.verify()
        assert b.version == 5
        # only a single oversized tensor may exceed the bucket size
        assert b.nbytes <= 1024 or len(b.metas) == 1
        for m in b.metas:
            assert m.offset % 64 == 0
    got = {n: t for b in buckets for n, t in b.tensors()}
    for name, tensor in named():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_corruption_fails_verification_with_reason():
    bucket = next(pack_buckets(named(), version=1, bucket_bytes=1 << 20))
    buf = bucket.buffer.clone()
    buf[3] ^= 1
    with pytest.raises(WeightTransferError, match="corrupted"):
        dataclasses.replace(bucket, buffer=buf).verify()
