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
    assert bucket.verified  # pack_buckets took the checksum from this very buffer
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


def _inprocess_roundtrip(buckets, *, recheck=False, between=None):
    from asyncflow_plugins.transports import InProcessTransport, InProcessTransportConfig

    async def feed(xs):
        for x in xs:
            yield x

    async def main():
        t = InProcessTransport(InProcessTransportConfig(recheck=recheck))
        try:
            await t.send(feed(buckets), deadline_s=30)
            if between is not None:
                between()
            return [b async for b in t.receive(min_version=buckets[0].version, deadline_s=30)]
        finally:
            await t.close()

    return asyncio.run(main())


def test_inprocess_receiver_trusts_the_senders_digest_of_the_same_untouched_buffer(monkeypatch):
    items = [(f"w{i}", torch.full((1 << 14,), float(i))) for i in range(4)]
    buckets = list(pack_buckets(items, version=3, bucket_bytes=1 << 16))
    hashed = []
    real = W.weight_digests
    monkeypatch.setattr(W, "weight_digests", lambda bufs: hashed.append(len(bufs)) or real(bufs))
    assert [b.checksum for b in _inprocess_roundtrip(buckets)] == [b.checksum for b in buckets]
    assert hashed == []  # the receiver did not hash what the sender hashed in this process
    asyncio.run(collect_update(3, _aiter(buckets)))
    assert hashed == []  # nor did the engine's checks
    again = list(pack_buckets(items, version=3, bucket_bytes=1 << 16))
    hashed.clear()
    _inprocess_roundtrip(again, recheck=True)
    assert sum(hashed) == len(buckets)  # recheck: every bucket hashed again


def test_inprocess_catches_a_torch_write_between_export_and_load_and_recheck_catches_a_numpy_one():
    items = [(f"w{i}", torch.full((1 << 14,), float(i))) for i in range(4)]

    def through_torch():
        buckets[1].buffer[7] ^= 0x40  # in place through torch: the version counter moves

    buckets = list(pack_buckets(items, version=2, bucket_bytes=1 << 16))
    with pytest.raises(WeightTransferError, match="weight bucket 1 of version 2 is corrupted"):
        _inprocess_roundtrip(buckets, between=through_torch)
    buckets = list(pack_buckets(items, version=2, bucket_bytes=1 << 16))
    view = next(iter(dict(buckets[2].tensors()).values()))
    with pytest.raises(WeightTransferError, match="bucket 2 of version 2 is corrupted"):
        _inprocess_roundtrip(buckets, between=lambda: view.mul_(2))  # a write through a tensor view of it
    # a write that bypasses torch (a numpy view of the memory) is what the trusted path does not see ...
    fresh = list(pack_buckets(items, version=2, bucket_bytes=1 << 16))

    def through_numpy():
        fresh[3].buffer.numpy()[0] ^= 0x01

    got = _inprocess_roundtrip(fresh, between=through_numpy)
    assert got[3].verified and W.weight_digest(got[3].buffer) != got[3].checksum  # the documented hole
    # ... and what recheck is for
    fresh = list(pack_buckets(items, version=2, bucket_bytes=1 << 16))
    with pytest.raises(WeightTransferError, match="bucket 3 of version 2 is corrupted"):
        _inprocess_roundtrip(fresh, recheck=True, between=through_numpy)


async def _aiter(xs):
    for x in xs:
        yield x


def test_the_fused_pack_writes_and_digests_what_a_plain_copy_would_across_span_boundaries():
    """pack_buckets fills and hashes each 8 MiB span in one task; the torch copy_ path is the oracle."""
    gen = torch.Generator().manual_seed(5)
    # odd sizes, so tensor ends and padding fall on both sides of the 8 MiB span boundaries
    items = [("a", torch.randn(1_300_001, generator=gen)), ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
             ("c", torch.randint(0, 9, (2_100_003,), generator=gen)), ("d", torch.rand(3) > 0.5),
             ("e", torch.randn(999_999, generator=gen).to(torch.float16)), ("empty", torch.empty(0))]
    dirty = torch.full((64 << 20,), 0xAB, dtype=torch.uint8)
    fused = list(pack_buckets(items, version=1, bucket_bytes=40 << 20, allocate=lambda n: dirty[:n]))
    assert len(fused) == 1 and fused[0].nbytes > 16 << 20
    # a non-contiguous view of each tensor (same values, stride 2) takes the copy_ path
    odd = [(n, torch.stack([t, t], 1)[:, 0]) for n, t in items]
    assert all(not t.is_contiguous() for n, t in odd if t.numel() > 1)
    plain = list(pack_buckets(odd, version=1, bucket_bytes=40 << 20))
    assert torch.equal(fused[0].buffer, plain[0].buffer)
    assert fused[0].checksum == plain[0].checksum == reference_digest(fused[0].buffer.numpy().tobytes())
    assert fused[0].verified
    got = dict(fused[0].tensors())
    for name, t in items:
        assert torch.equal(got[name], t)


def test_copy_tensors_copies_host_pairs_in_spans_and_the_rest_with_copy_():
    gen = torch.Generator().manual_seed(2)
    src = [torch.randn(3_000_001, generator=gen), torch.randn(5, 7, generator=gen).to(torch.bfloat16),
           torch.randn(4, 6, generator=gen)]
    dst = [torch.zeros(3_000_001), torch.zeros(5, 7, dtype=torch.bfloat16), torch.zeros(6, 4).t()]  # last: strided
    versions = [d._version for d in dst]
    W.copy_tensors(list(zip(dst, src, strict=True)))
    for d, s, v in zip(dst, src, versions, strict=True):
        assert torch.equal(d, s) and d._version > v  # in-place writes are visible to torch's version counter
