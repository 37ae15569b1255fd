"""``ExportArena``: weight-version buffers kept across versions, never rewritten while anything still holds them.

The oracle is independent of the arena: each version's bytes are snapshotted
(cloned) when it is packed, and every version a receiver still holds must
equal its snapshot and verify against its checksum after later exports.
Reuse is observed through the buffers' data pointers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.types import WeightBucket, pack_buckets
from asyncflow_core.types.weights import ExportArena, verify_buckets
from asyncflow_plugins.transports import InProcessTransport
from asyncflow_plugins.weight_transports.config import ShmTransportConfig
from asyncflow_plugins.weight_transports.shm import ShmWeightTransport

DEADLINE_S = 30.0


def weights(version: int, *, rows: int = 64) -> list[tuple[str, torch.Tensor]]:
    """Tensors whose values (and, with ``rows``, sizes) differ per version; the odd sizes leave alignment padding."""
    gen = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(rows, 16, generator=gen)),
        ("norm.weight", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("mlp.weight", torch.randn(16, 33, generator=gen)),
        ("head.bias", torch.randn(5, generator=gen)),
    ]


def export(arena: ExportArena | None, version: int, **kw) -> list[WeightBucket]:
    allocate = arena.allocator() if arena is not None else None
    return list(pack_buckets(weights(version, **kw), version=version, bucket_bytes=2048, allocate=allocate))


def snapshot(buckets: list[WeightBucket]) -> list[torch.Tensor]:
    return [b.buffer.clone() for b in buckets]


def assert_intact(buckets: list[WeightBucket], saved: list[torch.Tensor]) -> None:
    for bucket, before in zip(buckets, saved, strict=True):
        assert torch.equal(bucket.buffer, before), f"bucket {bucket.index} of version {bucket.version} was rewritten"
    verify_buckets([dataclass_copy(b) for b in buckets])  # hashed afresh, not the remembered verdict


def dataclass_copy(bucket: WeightBucket) -> WeightBucket:
    return WeightBucket(bucket.version, bucket.index, bucket.metas, bucket.buffer, bucket.checksum, bucket.last)


def pointers(buckets: list[WeightBucket]) -> set[int]:
    return {b.buffer.data_ptr() for b in buckets}


# ---------------------------------------------------------------- the arena alone


def test_a_dropped_version_is_reused_and_a_held_one_is_not() -> None:
    arena = ExportArena()
    first = pointers(export(arena, 1))  # dropped at once
    assert pointers(export(arena, 2)) == first  # one slot is enough while nothing holds a version
    staged = export(arena, 3)  # held, as a transport holds the version it staged
    assert pointers(staged) == first
    following = export(arena, 4)
    assert pointers(following).isdisjoint(first)  # double-buffered: the held version's slot is not touched
    staged = following  # the transport stages 4, dropping 3
    assert pointers(export(arena, 5)) == first
    stats = arena.stats()
    assert stats["slots"] == 2 and stats["fresh_versions"] == 0
    assert stats["reused_bytes"] == 3 * stats["allocated_bytes"] / 2  # versions 2, 3 and 5 reused
    del staged


def test_an_allocator_in_use_keeps_its_slot_from_another_export() -> None:
    arena = ExportArena()
    packing = arena.allocator()  # an export in progress that has not asked for a buffer yet
    other = arena.allocator()
    first = packing(256).data_ptr()
    assert first != other(256).data_ptr()
    assert arena.stats()["slots"] == 2
    del packing  # finished, its buffer dropped: its slot is free again; ``other`` still claims its own
    assert arena.allocator()(256).data_ptr() == first
    assert arena.stats()["slots"] == 2


def test_a_reused_buffer_packs_the_same_bytes_and_checksum_as_a_fresh_one() -> None:
    arena = ExportArena()
    dirty = export(arena, 1, rows=80)
    for bucket in dirty:
        bucket.buffer.fill_(0xAB)  # garbage in the padding of the buffers version 3 will reuse
    del dirty, bucket
    export(arena, 2)
    reused = export(arena, 3, rows=64)  # smaller than version 1: a reused buffer is cut to size
    fresh = export(None, 3, rows=64)
    assert arena.stats()["reused_bytes"] > 0
    assert [b.checksum for b in reused] == [b.checksum for b in fresh]
    for r, f in zip(reused, fresh, strict=True):
        assert torch.equal(r.buffer, f.buffer)
    larger = export(arena, 4, rows=200)  # larger than the kept buffers: new ones, same bytes as fresh
    assert [b.checksum for b in larger] == [b.checksum for b in export(None, 4, rows=200)]


@pytest.mark.parametrize("held", ["bucket", "view", "numpy"])
def test_a_version_held_in_any_form_is_never_rewritten(held: str) -> None:
    arena = ExportArena(max_slots=2)
    v1 = export(arena, 1)
    saved = snapshot(v1)
    keep = {"bucket": v1[0], "view": next(v1[0].tensors())[1], "numpy": v1[0].buffer.numpy()}[held]
    buffer_ptr = v1[0].buffer.data_ptr()
    del v1  # only ``keep`` holds anything of version 1
    staged = export(arena, 2)
    for v in (3, 4):  # each new version staged in turn, the one before dropped
        newest = export(arena, v)
        assert buffer_ptr not in pointers(newest)
        staged = newest
    assert arena.stats()["fresh_versions"] == 1  # version 3: v1's slot held by ``keep``, v2's staged
    if held == "bucket":
        held_bytes = keep.buffer
    elif held == "view":
        held_bytes = keep.reshape(-1).view(torch.uint8)
    else:
        held_bytes = torch.from_numpy(keep)
    assert torch.equal(held_bytes, saved[0][: held_bytes.numel()])
    del keep, held_bytes
    assert buffer_ptr in pointers(export(arena, 5))  # released: reused again
    del staged


def test_max_slots_must_allow_double_buffering() -> None:
    with pytest.raises(ValueError, match="max_slots >= 2"):
        ExportArena(max_slots=1)


def test_without_a_storage_use_count_every_version_gets_fresh_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    arena = ExportArena()
    seen: set[int] = set()
    live = []
    for v in range(1, 5):
        live.append(export(arena, v))
        seen |= pointers(live[-1])
    assert arena.stats()["fresh_versions"] == 4 and arena.stats()["slots"] == 0
    assert len(seen) == sum(len(b) for b in live)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["export", "drop"]), st.integers(0, 7)), min_size=1, max_size=25),
       st.integers(2, 4))
def test_every_held_version_keeps_its_bytes_whatever_is_exported_or_dropped(ops, max_slots: int) -> None:
    """A plain model: the versions still held and their snapshots; after each step all of them are intact."""
    arena = ExportArena(max_slots=max_slots)
    held: dict[int, tuple[list[WeightBucket], list[torch.Tensor]]] = {}
    version = 0
    for op, pick in ops:
        if op == "export":
            version += 1
            got = export(arena, version, rows=32 + 16 * (pick % 3))
            held[version] = (got, snapshot(got))
        elif held:
            del held[sorted(held)[pick % len(held)]]
        for buckets, saved in held.values():
            assert_intact(buckets, saved)
    assert arena.stats()["slots"] <= max_slots


# ---------------------------------------------------------------- through the transports


def test_inprocess_a_receiver_mid_version_is_never_overwritten_by_two_more_exports() -> None:
    """A receiver pauses after the first bucket of version 1; the trainer exports and sends 2 and 3 meanwhile."""

    async def main() -> None:
        arena = ExportArena()
        transport = InProcessTransport()
        try:
            v1 = export(arena, 1)
            assert len(v1) >= 3
            saved = snapshot(v1)
            await transport.send(aiter_of(v1), deadline_s=DEADLINE_S)
            del v1
            reading = transport.receive(min_version=1, deadline_s=DEADLINE_S)
            got = [await anext(reading)]  # mid-version: one bucket in hand, the rest still to come
            for v in (2, 3):
                sent = export(arena, v)
                await transport.send(aiter_of(sent), deadline_s=DEADLINE_S)
                del sent
            got += [b async for b in reading]
            assert [b.version for b in got] == [1] * len(saved)
            assert_intact(got, saved)
            stats = arena.stats()
            assert stats["slots"] == 3 and stats["fresh_versions"] == 0  # v3 could use neither v1's nor v2's slot
            latest = [b async for b in transport.receive(min_version=3, deadline_s=DEADLINE_S)]
            assert [b.checksum for b in latest] == [b.checksum for b in export(None, 3)]
            del got, latest
        finally:
            await transport.close()

    asyncio.run(main())


def staged_segment(sender: ShmWeightTransport) -> str:
    assert sender._staged is not None
    return sender._staged.segment


def packed(sender: ShmWeightTransport, v: int) -> list[WeightBucket]:
    return list(pack_buckets(weights(v), version=v, bucket_bytes=2048, allocate=sender.allocator()))


def test_shm_a_slot_a_receiver_maps_is_never_rewritten_and_is_reused_once_dropped() -> None:
    """Receivers map the segment (no copy); the sender skips a slot whose lock a mapping holds, not its bytes."""

    async def main() -> None:
        sender = ShmWeightTransport(ShmTransportConfig())
        seg: dict[int, str] = {}

        async def send(v: int) -> None:
            await sender.send(aiter_of(packed(sender, v) if v > 1 else export(None, v)), deadline_s=DEADLINE_S)
            seg[v] = staged_segment(sender)

        async def receive(v: int) -> list[WeightBucket]:
            got = [b async for b in sender.receive(min_version=v, deadline_s=DEADLINE_S)]
            assert [b.checksum for b in got] == [b.checksum for b in export(None, v)]
            assert_intact(got, snapshot(export(None, v)))  # bytes equal the packed ones
            return got

        try:
            await send(1)
            held = await receive(1)  # maps slot A
            assert all(b.buffer.untyped_storage().data_ptr() != sender._slots["a"].view.data_ptr() for b in held)
            await send(2)  # slot B
            await send(3)  # slot A is mapped: a new segment for it
            assert seg[3] not in (seg[1], seg[2]) and sender.stats()["slots_held"] == 1
            assert_intact(held, snapshot(export(None, 1)))  # two more versions sent: version 1 untouched
            assert not (sender.dir / seg[1]).exists()  # its name went; the mapping keeps the pages
            del held

            view = next(iter((await receive(3))[0].tensors()))[1]  # only a view of version 3's mapping is kept
            expected = view.clone()
            await send(4)  # slot B again: nobody maps it
            assert seg[4] == seg[2]
            await send(5)  # slot A holds version 3, still mapped through the view
            assert seg[5] != seg[3] and sender.stats()["slots_held"] == 2
            assert torch.equal(view, expected)
            del view

            got = await receive(5)
            del got  # dropped right after loading, as an engine does: the lock goes with the mapping
            await send(6)
            await send(7)
            assert (seg[6], seg[7]) == (seg[4], seg[5])  # both slots reused, no new segment
            assert sender.stats()["slots_held"] == 2
            await receive(7)
        finally:
            await sender.close()

    asyncio.run(main())


def test_shm_reuse_buffers_off_copies_into_fresh_memory() -> None:
    async def main() -> None:
        sender = ShmWeightTransport(ShmTransportConfig(reuse_buffers=False))
        try:
            assert not sender._map
            held = []
            for v in (1, 2, 3):
                await sender.send(aiter_of(export(None, v)), deadline_s=DEADLINE_S)
                got = [b async for b in sender.receive(min_version=v, deadline_s=DEADLINE_S)]
                assert [b.checksum for b in got] == [b.checksum for b in export(None, v)]
                held.append(got)
                if v == 1:
                    first = staged_segment(sender)
            # a private copy holds no lock: version 3 rewrote version 1's slot, and the copy is intact
            assert staged_segment(sender) == first and sender.stats()["slots_held"] == 0
            assert_intact(held[0], snapshot(export(None, 1)))
        finally:
            await sender.close()

    asyncio.run(main())


async def aiter_of(items):
    for item in items:
        yield item


# ---------------------------------------------------------------- shm: packed straight into the segment


def with_shm_sender(body: Callable[[ShmWeightTransport], Awaitable[None]]) -> None:
    """Run ``await body(sender)`` with a new shm sender, closed afterwards whatever happens."""

    async def main() -> None:
        sender = ShmWeightTransport(ShmTransportConfig())
        try:
            await body(sender)
        finally:
            await sender.close()

    asyncio.run(main())


async def receive(sender: ShmWeightTransport, v: int) -> list[WeightBucket]:
    """The newest version ``>= v`` (mapped), checked to carry the checksums version ``v`` was packed with."""
    got = [b async for b in sender.receive(min_version=v, deadline_s=DEADLINE_S)]
    assert [b.checksum for b in got] == [b.checksum for b in export(None, v)]
    return got


def test_shm_packs_straight_into_the_slot_its_next_send_writes() -> None:
    async def body(sender: ShmWeightTransport) -> None:
        places = []
        for v in (1, 2, 3, 4):
            sent = packed(sender, v)
            places.append(pointers(sent))
            await sender.send(aiter_of(sent), deadline_s=DEADLINE_S)
            del sent
            assert_intact(await receive(sender, v), snapshot(export(None, v)))
        stats = sender.stats()
        nbytes = sum(b.nbytes for b in export(None, 1))
        # the first version sizes the segment (copied in); every later one was packed in place, no copy
        assert stats == {"in_place_bytes": 3 * nbytes, "copied_bytes": nbytes, "slots_held": 0}
        assert places[1] == places[3] and places[1].isdisjoint(places[2])  # the two slots, alternately

    with_shm_sender(body)


def test_shm_a_receiver_reading_the_slot_being_packed_retries_instead_of_reading_torn_bytes() -> None:
    async def body(sender: ShmWeightTransport) -> None:
        await sender.send(aiter_of(packed(sender, 1)), deadline_s=DEADLINE_S)
        stale = sender._staged  # a slow receiver read this manifest (version 1, slot A) ...
        await sender.send(aiter_of(packed(sender, 2)), deadline_s=DEADLINE_S)
        packing = sender.allocator()
        packing(64)  # ... and version 3 starts packing into slot A, the one not holding version 2
        assert sender._read_version(stale) is None  # the header says "being written": the receiver retries
        got = [b async for b in sender.receive(min_version=1, deadline_s=DEADLINE_S)]
        assert [b.version for b in got] == [2] * len(got)

    with_shm_sender(body)


def test_shm_never_overwrites_packed_buckets_something_still_holds() -> None:
    async def body(sender: ShmWeightTransport) -> None:
        await sender.send(aiter_of(export(None, 1)), deadline_s=DEADLINE_S)
        held = {}
        for v in (2, 3, 4):  # every version packed into shared memory and sent, and all of them kept
            held[v] = packed(sender, v)
            saved = snapshot(held[v])
            await sender.send(aiter_of(held[v]), deadline_s=DEADLINE_S)
            held[v] = (held[v], saved)
        for buckets, saved in held.values():
            assert_intact(buckets, saved)
        # packed but not sent, then an older version sent the copying way: the packed bytes survive, and
        # sending them later copies them from where they lie
        v6 = packed(sender, 6)
        saved6 = snapshot(v6)
        await sender.send(aiter_of(export(None, 5)), deadline_s=DEADLINE_S)
        assert_intact(v6, saved6)
        await sender.send(aiter_of(v6), deadline_s=DEADLINE_S)
        assert_intact(await receive(sender, 6), saved6)

    with_shm_sender(body)


def test_shm_without_a_storage_use_count_copies_every_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_storage_Use_Count")

    async def body(sender: ShmWeightTransport) -> None:
        for v in (1, 2, 3):
            await sender.send(aiter_of(packed(sender, v)), deadline_s=DEADLINE_S)
            await receive(sender, v)
        assert sender.stats()["in_place_bytes"] == 0  # it cannot tell who holds a segment: never packs into one

    with_shm_sender(body)
