"""The ``shm`` receiver keeps its mapping of a slot across versions: the lock per version, the mapping kept.

A receiver maps each of the sender's two slots once and reads every later
version written into that slot through the same mapping (no page faults to
rebuild, no unmapping per version). What must still hold: the shared lock is
held exactly while a version's tensors live, the bytes yielded are verified
against the sender's digests every time, and what the receiver's own writes
left in its private (copy-on-write) pages never passes for a new version.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import uuid
from pathlib import Path

import pytest
import torch

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.types import WeightBucket, pack_buckets
from asyncflow_plugins.weight_transports.config import ShmTransportConfig
from asyncflow_plugins.weight_transports.shm import HEADER_BYTES, ShmManifest, ShmWeightTransport

DEADLINE_S = 30.0


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [("a", torch.randn(64, 48, generator=gen)), ("b", torch.randn(300, generator=gen))]


def packed(sender: ShmWeightTransport, version: int) -> list[WeightBucket]:
    return list(pack_buckets(weights(version), version=version, bucket_bytes=4096, allocate=sender.allocator()))


async def aiter_of(items):
    for item in items:
        yield item


def locked(path: Path, fd: int | None = None) -> bool:
    """Whether some reader holds the segment's shared lock (an exclusive try on a new open of it fails);
    ``fd``: a descriptor of the file opened earlier (its name may be gone)."""
    f = os.open(path, os.O_RDONLY) if fd is None else os.dup(fd)  # a dup shares the open file: reopen by fd
    try:
        f2 = os.open(f"/proc/self/fd/{f}", os.O_RDONLY)  # a new open file description of the same file
    finally:
        os.close(f)
    try:
        fcntl.flock(f2, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(f2)
    return False


def staged(sender: ShmWeightTransport) -> Path:
    return sender.dir / ShmManifest.model_validate_json(sender.manifest_path.read_bytes()).segment


def same_as(got: list[WeightBucket], version: int) -> bool:
    tensors = dict(t for b in got for t in b.tensors())
    return all(torch.equal(tensors[name], t) for name, t in weights(version))


def pair(body) -> None:
    """``await body(sender, receiver)``: a sender and a receiver object on one name, both closed afterwards."""

    async def main() -> None:
        name = f"k{uuid.uuid4().hex[:10]}"
        sender = ShmWeightTransport(ShmTransportConfig(name=name))
        receiver = ShmWeightTransport(ShmTransportConfig(name=name))
        try:
            await body(sender, receiver)
        finally:
            await receiver.close()
            await sender.close()

    asyncio.run(main())


async def send(sender: ShmWeightTransport, version: int) -> Path:
    await sender.send(aiter_of(packed(sender, version)), deadline_s=DEADLINE_S)
    return staged(sender)


async def receive(receiver: ShmWeightTransport, version: int) -> list[WeightBucket]:
    got = [b async for b in receiver.receive(min_version=version, deadline_s=DEADLINE_S)]
    assert got[0].version == version and same_as(got, version)
    return got


def payload_start(got: list[WeightBucket]) -> int:
    return got[0].buffer.data_ptr()


def test_each_slot_is_mapped_once_and_its_lock_lives_with_the_version() -> None:
    async def body(sender: ShmWeightTransport, receiver: ShmWeightTransport) -> None:
        starts: dict[int, int] = {}
        paths: dict[int, Path] = {}
        for v in range(1, 7):
            paths[v] = await send(sender, v)
            got = await receive(receiver, v)
            starts[v] = payload_start(got)
            assert locked(paths[v])  # held while the version's buffers live
            del got
            assert not locked(paths[v])  # and released with the last of them, the mapping kept
        assert paths[1] == paths[3] == paths[5] and paths[2] == paths[4] == paths[6] and paths[1] != paths[2]
        # every version in a slot was read through the one mapping of that slot
        assert starts[1] == starts[3] == starts[5] and starts[2] == starts[4] == starts[6]
        assert sorted(receiver._mappings) == sorted({paths[1].name, paths[2].name})
        assert sender.stats()["slots_held"] == 0
        await receiver.close()
        assert receiver._mappings == {}

    pair(body)


def test_a_version_still_held_keeps_its_slot_and_a_second_read_maps_it_again() -> None:
    async def body(sender: ShmWeightTransport, receiver: ShmWeightTransport) -> None:
        first = await send(sender, 1)
        fd = os.open(first, os.O_RDONLY)  # to ask about its lock once its name is gone
        held = await receive(receiver, 1)
        again = await receive(receiver, 1)  # the kept mapping is in use: a second, separate mapping
        assert payload_start(again) != payload_start(held)
        del held
        assert locked(first)  # the second read's lock is its own
        await send(sender, 2)
        third = await send(sender, 3)  # slot A is still mapped: a new segment, version 1 untouched
        assert third != first and sender.stats()["slots_held"] == 1 and same_as(again, 1)
        del again
        assert not locked(first, fd)
        os.close(fd)
        await receive(receiver, 3)
        assert first.name not in receiver._mappings  # its name went: unmapped at the next read

    pair(body)


def test_bytes_the_receiver_wrote_in_its_private_pages_never_pass_for_a_new_version() -> None:
    async def body(sender: ShmWeightTransport, receiver: ShmWeightTransport) -> None:
        await send(sender, 1)
        got = await receive(receiver, 1)
        got[0].buffer[:16] = 7  # copy-on-write: the receiver's own page now, not the segment's
        del got
        await send(sender, 2)
        await send(sender, 3)  # rewrites slot A; the receiver's kept mapping still has its written page
        await receive(receiver, 3)  # the digest catches the stale page; a fresh mapping reads version 3

    pair(body)


def test_a_kept_mapping_still_catches_a_flipped_byte_and_a_truncated_segment() -> None:
    async def body(sender: ShmWeightTransport, receiver: ShmWeightTransport) -> None:
        await send(sender, 1)
        del_me = await receive(receiver, 1)
        del del_me
        await send(sender, 2)
        path = await send(sender, 3)  # slot A again: the receiver has it mapped
        with open(path, "r+b") as f:  # bypass the API: damage the staged bytes in place
            f.seek(HEADER_BYTES + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(WeightTransferError, match="bucket 0 of version 3 is corrupted"):
            [b async for b in receiver.receive(min_version=3, deadline_s=5)]
        await send(sender, 4)
        path = await send(sender, 5)
        os.truncate(path, HEADER_BYTES + 10)
        with pytest.raises(WeightTransferError, match="partial"):
            [b async for b in receiver.receive(min_version=5, deadline_s=5)]

    pair(body)
