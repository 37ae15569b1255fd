"""Conformance tests for WeightTransport backends (sender and receiver in one process)."""

from __future__ import annotations

import dataclasses

import torch

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import WeightTransport
from asyncflow_core.plugins import PluginKind
from asyncflow_core.types import WeightBucket, pack_buckets
from asyncflow_spec.base import BackendSpec, run


def weights(version: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + version)
    return [
        ("embed.weight", torch.randn(32, 8, generator=gen)),
        ("layer.0.bias", torch.randn(8, generator=gen).to(torch.bfloat16)),
        ("head.weight", torch.randn(8, 32, generator=gen)),
    ]


async def _aiter(items):
    for item in items:
        yield item


class WeightTransportSpec(BackendSpec):
    """Subclass and set ``backend``/``options``. Tests send and receive from one process."""

    kind = PluginKind.WEIGHT_TRANSPORT
    bucket_bytes = 1024

    def test_round_trip_is_bit_exact(self, make_backend):
        """What ``receive`` yields equals what was sent, tensor by tensor, and the report counts it."""

        async def body():
            t: WeightTransport = make_backend()
            try:
                sent = list(pack_buckets(weights(1), version=1, bucket_bytes=self.bucket_bytes))
                report = await t.send(_aiter(sent), deadline_s=30)
                assert report.version == 1 and report.buckets == len(sent)
                assert report.bytes == sum(b.nbytes for b in sent)
                got = [b async for b in t.receive(min_version=1, deadline_s=30)]
                names = dict(n_t for b in got for n_t in b.tensors())
                for name, tensor in weights(1):
                    assert torch.equal(names[name], tensor), name
            finally:
                await t.close()

        run(body())

    def test_receive_times_out_with_reason(self, make_backend):
        """Waiting for a version nobody sends fails with WeightTransferError after the deadline, never hangs."""

        async def body():
            t: WeightTransport = make_backend()
            try:
                try:
                    [b async for b in t.receive(min_version=7, deadline_s=0.2)]
                except WeightTransferError as exc:
                    assert str(exc), "the error must say why"
                    return
                raise AssertionError("receive returned without any version staged")
            finally:
                await t.close()

        run(body())

    def test_incomplete_version_is_refused(self, make_backend):
        """A send missing its last bucket (or with a gap) raises WeightTransferError; the staged version stays."""

        async def body():
            t: WeightTransport = make_backend()
            try:
                first = list(pack_buckets(weights(1), version=1, bucket_bytes=self.bucket_bytes))
                await t.send(_aiter(first), deadline_s=30)
                broken = list(pack_buckets(weights(2), version=2, bucket_bytes=self.bucket_bytes))[:-1]
                try:
                    await t.send(_aiter(broken), deadline_s=30)
                    raise AssertionError("an incomplete version was accepted")
                except WeightTransferError:
                    pass
                got = [b async for b in t.receive(min_version=0, deadline_s=30)]
                assert {b.version for b in got} == {1}
            finally:
                await t.close()

        run(body())

    def test_corruption_is_detected(self, make_backend):
        """A bucket whose bytes do not match its checksum never reaches a receiver unverified."""

        async def body():
            t: WeightTransport = make_backend()
            try:
                sent = list(pack_buckets(weights(3), version=3, bucket_bytes=self.bucket_bytes))
                bad_buffer = sent[0].buffer.clone()
                bad_buffer[0] ^= 0xFF
                sent[0] = dataclasses.replace(sent[0], buffer=bad_buffer)
                try:
                    await t.send(_aiter(sent), deadline_s=30)
                    [b async for b in t.receive(min_version=3, deadline_s=5)]
                except WeightTransferError:
                    return
                raise AssertionError("a corrupted bucket was delivered")
            finally:
                await t.close()

        run(body())
