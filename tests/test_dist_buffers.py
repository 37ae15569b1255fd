"""``dist`` receivers over gloo keep their payload buffers across versions (``keep_buffers``).

Both ranks live in this process (each transport forms its own gloo group on
its own thread), so the test can see the receiver's buffers: a kept buffer
is reused only once nothing holds the version it carried, a version the
caller still holds is never rewritten, and ``keep_buffers: false`` receives
every version into fresh memory.
"""

from __future__ import annotations

import pytest
import torch
from asyncflow_spec.base import run

from asyncflow_plugins.weight_transports.config import DistTransportConfig
from asyncflow_plugins.weight_transports.dist import DistWeightTransport
from asyncflow_plugins.weight_transports.manifest import manifest_for
from tests.test_transports import aiter, buckets, free_port, model

WAIT_S = 60


def _pair(**options) -> tuple[DistWeightTransport, DistWeightTransport]:
    port = free_port()
    common = dict(world_size=2, port=port, join_timeout_s=WAIT_S, chunk_mb=1 / 1024, **options)
    return (DistWeightTransport(DistTransportConfig(rank=0, **common)),
            DistWeightTransport(DistTransportConfig(rank=1, **common)))


async def _sync(source: DistWeightTransport, receiver: DistWeightTransport, version: int) -> list:
    await source.send(aiter(buckets(version, bucket_bytes=700)), deadline_s=WAIT_S)
    return [b async for b in receiver.receive(min_version=version, deadline_s=WAIT_S)]


def _exact(got: list, version: int) -> bool:
    tensors = {name: t for b in got for name, t in b.tensors()}
    expected = dict(model(version))
    return tensors.keys() == expected.keys() and all(torch.equal(tensors[n], t) for n, t in expected.items())


def test_a_held_version_is_never_rewritten_and_a_dropped_ones_buffer_is_reused():
    async def body():
        source, receiver = _pair()
        try:
            held = await _sync(source, receiver, 1)  # the caller keeps version 1's buckets throughout
            got = await _sync(source, receiver, 2)
            assert _exact(got, 2)
            ptr2 = got[0].buffer.data_ptr()
            del got  # version 2 stays staged until version 3 replaces it
            got = await _sync(source, receiver, 3)  # 1 held, 2 staged: a third buffer
            assert _exact(got, 3)
            ptr3 = got[0].buffer.data_ptr()
            del got
            got = await _sync(source, receiver, 4)  # 2 is dropped and no longer staged: its buffer is taken again
            assert _exact(got, 4) and got[0].buffer.data_ptr() == ptr2 != ptr3
            del got
            assert _exact(held, 1)  # three versions later, every byte of the held version is intact
            assert all(torch.equal(b.buffer, ref.buffer) for b, ref in zip(held, buckets(1, bucket_bytes=700),
                                                                            strict=True))
            stats = receiver.buffer_stats()
            payload = manifest_for(buckets(4, bucket_bytes=700)).total_bytes  # the same layout in every version
            assert stats == {"versions": 4, "reused_bytes": payload, "allocated_bytes": 3 * payload,
                             "fresh_versions": 0, "slots": 3, "kept_bytes": 3 * payload}
            assert source.buffer_stats() is None  # the source receives nothing
        finally:
            await source.close()
            await receiver.close()

    run(body())


def test_without_keep_buffers_every_version_gets_fresh_memory():
    async def body():
        source, receiver = _pair(keep_buffers=False)
        try:
            first = await _sync(source, receiver, 1)
            second = await _sync(source, receiver, 2)
            assert _exact(first, 1) and _exact(second, 2)
            assert receiver.buffer_stats() is None
        finally:
            await source.close()
            await receiver.close()

    run(body())


def test_keep_buffers_is_an_option_with_a_default():
    assert DistTransportConfig().keep_buffers is True
    with pytest.raises(ValueError, match="keep_buffers"):
        DistTransportConfig(keep_buffers="sometimes")


@pytest.mark.slow  # four spawned interpreters import torch: ~10 s on 2 loaded cores
def test_the_ceiling_benchmark_measures_every_row(monkeypatch):
    """``benchmarks/dist_ceiling.py`` at a tiny size: one row per variant, pair count and message size, and a socket."""
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    sys.modules.pop("dist_ceiling", None)
    import dist_ceiling

    report = dist_ceiling.run(2, [1, 2], [1], list(dist_ceiling.VARIANTS), 1, True)
    rows = {(r["path"], r["connections"], r["chunk_mb"]) for r in report["results"]}
    assert rows == {(f"gloo/{v}", c, 1) for v in dist_ceiling.VARIANTS for c in (1, 2)} | {("socket", 1, 2)}
    assert all(r["seconds"] > 0 and r["gb_per_s"] > 0 for r in report["results"])
