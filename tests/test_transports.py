"""The verified weight transports ``shm``, ``dist`` and ``disk``: conformance, cross-process runs, failure reasons.

Same-process: the conformance suite against each (``dist`` as a one-rank
group). Cross-process: spawned receivers for ``shm``, a spawned three-rank
gloo group for ``dist``, a second (sending) process for ``disk``. Failures:
a flipped byte is an error naming the bucket, a partial transfer and a late
one are errors with a reason, quickly; no shared-memory file outlives its
sender. Processes talk to the test over pipes, and every wait has a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import glob
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import time
import traceback
import uuid
from pathlib import Path

import pytest
import torch
from asyncflow_spec import WeightTransportSpec
from asyncflow_spec.base import run

from asyncflow_core.errors import ConfigError, WeightTransferError
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import WeightBucket, pack_buckets
from asyncflow_plugins.weight_transports.config import DiskTransportConfig, DistTransportConfig, ShmTransportConfig
from asyncflow_plugins.weight_transports.disk import DiskWeightTransport
from asyncflow_plugins.weight_transports.dist import DistWeightTransport, chunk_ranges
from asyncflow_plugins.weight_transports.shm import HEADER_BYTES, PREFIX, ShmManifest, ShmWeightTransport

WAIT_S = 60  # the most any pipe wait may take (a spawned interpreter imports torch first)
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


# ---------------------------------------------------------------- helpers


def model(version: int) -> list[tuple[str, torch.Tensor]]:
    """A small state dict with bf16 and fp32 tensors, different per version."""
    gen = torch.Generator().manual_seed(1000 + version)
    return [
        ("embed.weight", torch.randn(64, 16, generator=gen)),
        ("layer.0.norm", torch.randn(16, generator=gen).to(torch.bfloat16)),
        ("layer.0.mlp", torch.randn(16, 48, generator=gen).to(torch.bfloat16)),
        ("head.bias", torch.randn(7, generator=gen)),
    ]


def buckets(version: int, bucket_bytes: int = 2048) -> list[WeightBucket]:
    return list(pack_buckets(model(version), version=version, bucket_bytes=bucket_bytes))


def corrupted(items: list[WeightBucket], index: int) -> list[WeightBucket]:
    """Flip one byte of bucket ``index`` after its checksum was taken (what a bad wire or disk would do)."""
    bad = items[index].buffer.clone()
    bad[3] ^= 0x5A
    return [dataclasses.replace(b, buffer=bad) if b.index == index else b for b in items]


async def aiter(items):
    for item in items:
        yield item


async def received(transport, min_version: int, deadline_s: float = 30) -> dict[str, torch.Tensor]:
    got = [b async for b in transport.receive(min_version=min_version, deadline_s=deadline_s)]
    assert {b.version for b in got} == {got[0].version}
    return {name: t.clone() for b in got for name, t in b.tensors()}


def same_as(tensors: dict[str, torch.Tensor], version: int) -> bool:
    expected = dict(model(version))
    return tensors.keys() == expected.keys() and all(
        tensors[n].dtype == t.dtype and torch.equal(tensors[n], t) for n, t in expected.items()
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_addresses(pid: int) -> list[str] | None:
    """Hosts that ``pid`` listens on (TCP), from ``ss``; None when ``ss`` is not installed."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=False).stdout
    return [line.split()[3].rpartition(":")[0] for line in out.splitlines() if f"pid={pid}," in line]


def ctx():
    return mp.get_context("spawn")


def expect(conn, *, what: str):
    """The next message from a child; an ('error', tb) message or silence fails the test with the child's story."""
    if not conn.poll(WAIT_S):
        pytest.fail(f"no message from the child process within {WAIT_S}s while waiting for {what}")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        pytest.fail(f"child process failed while the test waited for {what}:\n{msg[1]}")
    return msg


def child_main(role, conn, *args) -> None:
    """Entry point of every spawned process: run ``role`` and report a traceback instead of dying silently."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        asyncio.run(role(conn, *args))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def shm_files(name: str, directory: str | None = SHM_DIR) -> list[str]:
    return sorted(glob.glob(os.path.join(directory or "/tmp", f"{PREFIX}{name}*")))


# ---------------------------------------------------------------- conformance, same process


class TestShmSpec(WeightTransportSpec):
    backend = "shm"


class TestDistSpec(WeightTransportSpec):
    backend = "dist"  # a one-rank group on an ephemeral loopback port: send stages, receive reads it back


class TestDiskSpec(WeightTransportSpec):
    backend = "disk"  # a private temporary directory, removed on close


def test_registered_with_honest_features():
    pm = get_plugin_manager()
    for name, devices in (("shm", ("cpu",)), ("dist", ("cpu", "cuda")), ("disk", ("cpu",))):
        record = pm.lookup("weight_transport", name).record
        assert record.features.cross_process and not record.features.cross_host
        assert record.features.devices == devices
        with pytest.raises(ConfigError):
            pm.validate_options("weight_transport", name, {"no_such_option": 1})
        for field in record.config_model.model_fields.values():
            assert field.description, f"{name}: every option needs a description"


def test_dist_options_are_checked():
    with pytest.raises(ValueError, match="fixed port"):
        DistTransportConfig(rank=0, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        DistTransportConfig(rank=2, world_size=2, port=1234)


def test_chunk_ranges_cover_the_payload_exactly():
    for total, chunk in ((1, 64), (64, 64), (65, 64), (1000, 128)):
        ranges = chunk_ranges(total, chunk)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(b - a == chunk for a, b in ranges[:-1]) and all(a == b_prev for (_, b_prev), (a, _) in
                                                                   zip(ranges, ranges[1:]))


@pytest.mark.parametrize("name", ["shm", "dist", "disk"])
def test_multi_bucket_bf16_round_trip_and_newest_wins(name):
    """Several buckets, bf16 and fp32, bit-exact; after two sends a receive yields the newer version."""

    async def body():
        t = get_plugin_manager().create("weight_transport", name, {})
        try:
            first = buckets(1, bucket_bytes=512)
            assert len(first) > 2
            await t.send(aiter(first), deadline_s=30)
            await t.send(aiter(buckets(2, bucket_bytes=512)), deadline_s=30)
            got = await received(t, min_version=1)
            assert same_as(got, 2)
            assert got["layer.0.mlp"].dtype == torch.bfloat16
            with pytest.raises(WeightTransferError, match="not newer"):
                await t.send(aiter(buckets(2)), deadline_s=30)
        finally:
            await t.close()

    run(body())


@pytest.mark.parametrize("name", ["shm", "dist", "disk"])
def test_late_version_fails_quickly_with_reason(name):
    async def body():
        t = get_plugin_manager().create("weight_transport", name, {})
        try:
            await t.send(aiter(buckets(1)), deadline_s=30)
            start = time.monotonic()
            with pytest.raises(WeightTransferError, match=r">= 9 .*newest.*1"):
                [b async for b in t.receive(min_version=9, deadline_s=0.3)]
            assert time.monotonic() - start < 2.0
        finally:
            await t.close()

    run(body())


def test_closed_transport_refuses_calls():
    async def body():
        for t in (ShmWeightTransport(), DiskWeightTransport(), DistWeightTransport()):
            await t.close()
            await t.close()  # twice is fine
            with pytest.raises(WeightTransferError, match="closed"):
                await t.send(aiter(buckets(1)), deadline_s=1)

    run(body())


# ---------------------------------------------------------------- shm


def shm_segment_path(t: ShmWeightTransport) -> tuple[Path, ShmManifest]:
    manifest = ShmManifest.model_validate_json(t.manifest_path.read_bytes())
    return t.dir / manifest.segment, manifest


def test_shm_flipped_byte_names_the_bucket():
    async def body():
        t = ShmWeightTransport(ShmTransportConfig())
        try:
            await t.send(aiter(buckets(4, bucket_bytes=512)), deadline_s=30)
            path, manifest = shm_segment_path(t)
            target = manifest.weights.buckets[2]
            with open(path, "r+b") as f:  # bypass the API: damage the staged bytes in place
                f.seek(HEADER_BYTES + target.offset + 5)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            with pytest.raises(WeightTransferError, match="bucket 2 of version 4 is corrupted"):
                await received(t, min_version=4, deadline_s=5)
        finally:
            await t.close()

    run(body())


def test_shm_truncated_segment_is_a_partial_transfer():
    async def body():
        t = ShmWeightTransport(ShmTransportConfig())
        try:
            await t.send(aiter(buckets(1)), deadline_s=30)
            path, _ = shm_segment_path(t)
            os.truncate(path, HEADER_BYTES + 10)
            with pytest.raises(WeightTransferError, match="partial"):
                await received(t, min_version=1, deadline_s=5)
        finally:
            await t.close()

    run(body())


def test_shm_double_buffering_and_no_leaks():
    """v+1 goes to the other slot; sizes that grow get a new segment; close (or GC) leaves no file behind."""

    async def body():
        name = f"t{uuid.uuid4().hex[:10]}"
        t = ShmWeightTransport(ShmTransportConfig(name=name))
        await t.send(aiter(buckets(1)), deadline_s=30)
        first, _ = shm_segment_path(t)
        await t.send(aiter(buckets(2)), deadline_s=30)
        second, _ = shm_segment_path(t)
        assert first != second and first.exists(), "v1 must stay readable while v2 is staged"
        await t.send(aiter(buckets(3)), deadline_s=30)
        assert shm_segment_path(t)[0] == first  # slots alternate
        big = list(pack_buckets([("w", torch.ones(50_000))], version=4, bucket_bytes=1 << 20))
        await t.send(aiter(big), deadline_s=30)
        assert len(shm_files(name)) == 3  # two slots and the manifest
        await t.close()
        assert shm_files(name) == []

        dropped = ShmWeightTransport(ShmTransportConfig(name=name))
        await dropped.send(aiter(buckets(1)), deadline_s=30)
        assert shm_files(name)
        # the executor's worker thread may still hold the staging call for a moment: join the workers first
        await asyncio.get_running_loop().shutdown_default_executor()
        del dropped
        gc.collect()
        assert shm_files(name) == [], "an unclosed sender's segments must go when it is collected"

    run(body())


async def _shm_receiver(conn, name: str) -> None:
    t = ShmWeightTransport(ShmTransportConfig(name=name))
    conn.send(("v1", same_as(await received(t, min_version=1), 1)))
    conn.send(("v2", same_as(await received(t, min_version=2), 2)))  # the sender stages v2 after reading "v1"
    try:
        [b async for b in t.receive(min_version=3, deadline_s=0.3)]
        conn.send(("late", "no error"))
    except WeightTransferError as exc:
        conn.send(("late", str(exc)))
    await t.close()
    # now play a sender that is killed: it stages a version and exits without close()
    orphan = ShmWeightTransport(ShmTransportConfig(name=f"{name}.orphan"))
    await orphan.send(aiter(buckets(1)), deadline_s=30)
    conn.send(("orphaned", os.getpid()))
    os._exit(0)


@pytest.mark.skipif(SHM_DIR is None, reason="needs /dev/shm")
def test_shm_across_processes_and_stale_segments_are_swept():
    name = f"x{uuid.uuid4().hex[:10]}"
    parent, child = ctx().Pipe()
    proc = ctx().Process(target=child_main, args=(_shm_receiver, child, name))

    async def body():
        t = ShmWeightTransport(ShmTransportConfig(name=name))
        try:
            await t.send(aiter(buckets(1)), deadline_s=30)
            proc.start()
            assert expect(parent, what="v1") == ("v1", True)
            await t.send(aiter(buckets(2)), deadline_s=30)
            assert expect(parent, what="v2") == ("v2", True)
            kind, why = expect(parent, what="the late receive")
            assert kind == "late" and ">= 3" in why and "newest staged: 2" in why
            _, pid = expect(parent, what="the orphaned sender")
            proc.join(WAIT_S)
            orphans = shm_files(f"{name}.orphan")
            assert any(f"-{pid}-" in p for p in orphans), "the killed sender left its segment (as expected)"
            heir = ShmWeightTransport(ShmTransportConfig(name=f"{name}.orphan"))
            await heir.send(aiter(buckets(5)), deadline_s=30)  # takes over the name, sweeps the dead pid's files
            assert not any(f"-{pid}-" in p for p in shm_files(f"{name}.orphan"))
            assert same_as(await received(heir, min_version=5), 5)
            await heir.close()
        finally:
            await t.close()
            if proc.is_alive():
                proc.kill()
        assert shm_files(name) == []

    run(body())


async def _shm_holder(conn, name: str) -> None:
    """Map version 1 and hold it; on request, check it is still intact; wait to be killed."""
    t = ShmWeightTransport(ShmTransportConfig(name=name))
    held = [b async for b in t.receive(min_version=1, deadline_s=WAIT_S)]
    conn.send(("holding", same_as({n: x.clone() for b in held for n, x in b.tensors()}, 1)))
    conn.recv()
    conn.send(("intact", same_as({n: x.clone() for b in held for n, x in b.tensors()}, 1)))
    conn.recv()  # never comes: the test kills this process while it holds the mapping


def _segment_locked(path: Path) -> bool:
    """Whether a receiver holds ``path``'s shared lock (our exclusive try fails)."""
    import fcntl

    with open(path, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


@contextlib.asynccontextmanager
async def _version_1_held_by_another_process():
    """A sender that staged version 1, which a receiver in another process maps (``_shm_holder``):
    ``(sender, version 1's segment, pipe to the receiver, its process)``. On the way out the receiver is killed
    and the sender closed, and nothing of the transport's name may be left in shared memory."""
    name = f"m{uuid.uuid4().hex[:10]}"
    parent, child = ctx().Pipe()
    proc = ctx().Process(target=child_main, args=(_shm_holder, child, name))
    t = ShmWeightTransport(ShmTransportConfig(name=name))
    try:
        await t.send(aiter(buckets(1)), deadline_s=30)
        v1, _ = shm_segment_path(t)
        proc.start()
        assert expect(parent, what="the receiver to map version 1") == ("holding", True)
        assert _segment_locked(v1)
        yield t, v1, parent, proc
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(WAIT_S)
        await t.close()
    assert shm_files(name) == []


@pytest.mark.skipif(SHM_DIR is None, reason="needs /dev/shm")
def test_shm_a_segment_another_process_maps_is_kept_until_it_dies():
    """The receiver maps (no copy) under a shared lock: two more sends take other segments; its death frees it."""

    async def body():
        async with _version_1_held_by_another_process() as (t, v1, parent, proc):
            await t.send(aiter(buckets(2)), deadline_s=30)
            await t.send(aiter(buckets(3)), deadline_s=30)  # version 1's slot is mapped: a new segment
            v3, _ = shm_segment_path(t)
            assert v3 != v1 and t.stats()["slots_held"] == 1
            parent.send("check")
            assert expect(parent, what="the receiver to re-read version 1") == ("intact", True)
            assert same_as(await received(t, min_version=3), 3)
            assert not _segment_locked(v3)  # this process mapped version 3 and dropped it: no lock left behind

    run(body())


@pytest.mark.skipif(SHM_DIR is None, reason="needs /dev/shm")
def test_shm_a_receiver_that_dies_releases_its_segment():
    async def body():
        async with _version_1_held_by_another_process() as (t, v1, _, proc):
            proc.kill()  # SIGKILL: no close, no finalizer; the kernel drops its lock with its files
            proc.join(WAIT_S)
            assert not _segment_locked(v1)
            await t.send(aiter(buckets(2)), deadline_s=30)
            await t.send(aiter(buckets(3)), deadline_s=30)
            assert shm_segment_path(t)[0] == v1 and t.stats()["slots_held"] == 0  # its slot is reused
            assert same_as(await received(t, min_version=3), 3)

    run(body())


@pytest.mark.skipif(SHM_DIR is None, reason="needs /dev/shm")
def test_shm_a_full_shared_memory_file_system_is_refused_in_one_line(monkeypatch):
    """tmpfs grants a segment of any size and then SIGBUSes the writer past its limit: the sender checks first."""
    from asyncflow_core import kept_segments

    async def body():
        t = ShmWeightTransport(ShmTransportConfig(name=f"f{uuid.uuid4().hex[:10]}"))
        try:
            await t.send(aiter(buckets(1)), deadline_s=30)
            monkeypatch.setattr(kept_segments, "shm_free_bytes", lambda _d: 1024)
            with pytest.raises(WeightTransferError,
                               match=r"^/dev/shm has 0 MiB free but a weight version needs .*--shm-size"):
                await t.send(aiter(buckets(2)), deadline_s=30)  # its slot has no segment yet: it needs a new one
            assert same_as(await received(t, min_version=1), 1)  # the staged version stays current
            monkeypatch.undo()
            await t.send(aiter(buckets(3)), deadline_s=30)  # room again: the same sender goes on
            assert same_as(await received(t, min_version=3), 3)
        finally:
            await t.close()
        assert shm_files(t.name) == []

    run(body())


# ---------------------------------------------------------------- disk


def test_disk_flipped_byte_names_the_bucket(tmp_path):
    async def body():
        t = DiskWeightTransport(DiskTransportConfig(path=str(tmp_path)))
        try:
            sent = buckets(3, bucket_bytes=512)
            await t.send(aiter(sent), deadline_s=30)
            file = tmp_path / "v000000000003" / "weights.safetensors"
            data = bytearray(file.read_bytes())
            data[-7] ^= 0xFF  # the tensors lie in index order: the last bytes belong to the last bucket
            file.write_bytes(bytes(data))
            with pytest.raises(WeightTransferError, match=f"bucket {len(sent) - 1} of version 3 is corrupted"):
                await received(t, min_version=3, deadline_s=5)
        finally:
            await t.close()

    run(body())


def test_disk_partial_version_is_refused(tmp_path):
    async def body():
        t = DiskWeightTransport(DiskTransportConfig(path=str(tmp_path)))
        try:
            await t.send(aiter(buckets(1)), deadline_s=30)
            (tmp_path / "v000000000001" / "weights.safetensors").unlink()
            with pytest.raises(WeightTransferError, match="partial"):
                await received(t, min_version=1, deadline_s=5)
            (tmp_path / "v000000000001" / "weights.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
            with pytest.raises(WeightTransferError, match="cannot be read"):
                await received(t, min_version=1, deadline_s=5)
        finally:
            await t.close()

    run(body())


async def _disk_sender(conn, path: str) -> None:
    t = DiskWeightTransport(DiskTransportConfig(path=path, keep_last=2))
    conn.recv()  # the receiver is waiting
    for version in (1, 2, 3):
        await t.send(aiter(buckets(version)), deadline_s=30)
    # leave a half-written version behind, as a killed sender would
    (Path(path) / f".tmp-v000000000004-{os.getpid()}-{uuid.uuid4().hex[:12]}").mkdir()
    await t.close()
    conn.send("sent")


def test_disk_across_processes_newest_complete_version_and_gc(tmp_path):
    parent, child = ctx().Pipe()
    proc = ctx().Process(target=child_main, args=(_disk_sender, child, str(tmp_path)))
    proc.start()

    async def body():
        t = DiskWeightTransport(DiskTransportConfig(path=str(tmp_path), poll_interval_s=0.01))
        try:
            waiting = asyncio.ensure_future(received(t, min_version=3, deadline_s=WAIT_S))
            parent.send("go")
            got = await waiting
            assert same_as(got, 3)
            await asyncio.to_thread(expect, parent, what="the sender to finish")
            assert t.versions() == [2, 3], "keep_last=2"
            proc.join(WAIT_S)
            sender = DiskWeightTransport(DiskTransportConfig(path=str(tmp_path)))
            await sender.send(aiter(buckets(4)), deadline_s=30)  # sweeps the dead sender's temporary dir
            assert sorted(p.name for p in tmp_path.iterdir()) == ["v000000000003", "v000000000004"]
            await sender.close()
        finally:
            await t.close()
            if proc.is_alive():
                proc.kill()

    run(body())


# ---------------------------------------------------------------- dist


async def _dist_rank(conn, rank: int, world: int, port: int) -> None:
    """Rank 0 sends; the others receive. The parent steps every rank through the phases."""
    t = DistWeightTransport(DistTransportConfig(rank=rank, world_size=world, port=port, chunk_mb=1 / 1024,
                                                join_timeout_s=WAIT_S))
    try:
        if rank == 0:
            await t.send(aiter(buckets(1, bucket_bytes=700)), deadline_s=WAIT_S)  # 1 KiB chunks straddle buckets
            conn.send(("sent 1", listening_addresses(os.getpid())))
            conn.recv()
            try:
                await t.send(aiter(corrupted(buckets(2, bucket_bytes=700), index=1)), deadline_s=WAIT_S)
                conn.send(("sent 2", "no error"))
            except WeightTransferError as exc:
                conn.send(("sent 2", str(exc)))
            conn.recv()
            await t.send(aiter(buckets(3, bucket_bytes=700)), deadline_s=WAIT_S)
            conn.send("sent 3")
        else:
            conn.send(("got 1", same_as(await received(t, min_version=1, deadline_s=WAIT_S), 1)))
            try:
                await received(t, min_version=2, deadline_s=WAIT_S)
                conn.send(("got 2", "no error"))
            except WeightTransferError as exc:
                conn.send(("got 2", str(exc)))
            conn.send(("got 3", same_as(await received(t, min_version=3, deadline_s=WAIT_S), 3)))
            start = time.monotonic()
            try:
                await received(t, min_version=4, deadline_s=0.3)
                conn.send(("late", "no error", 0.0))
            except WeightTransferError as exc:
                conn.send(("late", str(exc), time.monotonic() - start))
        conn.recv()  # every rank is done: close together
    finally:
        await t.close()


def test_dist_three_ranks_over_gloo():
    """A source and two receivers: bit-exact versions, a corrupt bucket refused by name, the group still usable."""
    port = free_port()
    world = 3
    pipes = [ctx().Pipe() for _ in range(world)]
    procs = [ctx().Process(target=child_main, args=(_dist_rank, pipes[r][1], r, world, port)) for r in range(world)]
    for p in procs:
        p.start()
    source, receivers = pipes[0][0], [pipe[0] for pipe in pipes[1:]]
    try:
        kind, listening = expect(source, what="version 1 sent")
        assert kind == "sent 1"
        if listening is not None:  # rendezvous and gloo pairs: loopback only
            assert listening and all(host in ("127.0.0.1", "[::ffff:127.0.0.1]") for host in listening), listening
        for conn in receivers:
            assert expect(conn, what="version 1 received") == ("got 1", True)
        source.send("next")
        kind, why = expect(source, what="the corrupt version 2")
        assert kind == "sent 2" and "refused" in why and "bucket 1 of version 2 is corrupted" in why
        assert "rank 1" in why and "rank 2" in why
        for conn in receivers:
            kind, why = expect(conn, what="the refusal of version 2")
            assert kind == "got 2" and "bucket 1 of version 2 is corrupted" in why
        source.send("next")
        assert expect(source, what="version 3 sent") == "sent 3"
        for conn in receivers:
            assert expect(conn, what="version 3 received") == ("got 3", True)
            kind, why, seconds = expect(conn, what="the late receive")
            assert kind == "late" and ">= 4" in why and seconds < 2.0
        for conn, _ in pipes:
            conn.send("close")
        for p in procs:
            p.join(WAIT_S)
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_dist_missing_ranks_fail_the_send_in_time():
    """A group whose other rank never joins: send fails at its deadline with the reason, it does not hang."""

    async def body():
        t = DistWeightTransport(DistTransportConfig(rank=0, world_size=2, port=free_port(), join_timeout_s=2))
        try:
            start = time.monotonic()
            with pytest.raises(WeightTransferError, match="did not all join"):
                await t.send(aiter(buckets(1)), deadline_s=0.5)
            assert time.monotonic() - start < 3.0
        finally:
            await t.close()

    run(body())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="the NCCL path needs two CUDA devices (one per rank)")
def test_dist_nccl_two_ranks():  # pragma: no cover - runs only on a multi-GPU machine
    port = free_port()
    pipes = [ctx().Pipe() for _ in range(2)]
    procs = [ctx().Process(target=child_main, args=(_nccl_rank, pipes[r][1], r, port)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert expect(pipes[0][0], what="the NCCL send") == "sent"
        assert expect(pipes[1][0], what="the NCCL receive") == ("got", True)
        for p in procs:
            p.join(WAIT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


async def _nccl_rank(conn, rank: int, port: int) -> None:  # pragma: no cover - multi-GPU only
    torch.cuda.set_device(rank)
    t = DistWeightTransport(DistTransportConfig(rank=rank, world_size=2, port=port, backend="nccl"))
    try:
        if rank == 0:
            cuda = [(n, x.cuda()) for n, x in model(1)]
            await t.send(aiter(list(pack_buckets(cuda, version=1, bucket_bytes=2048))), deadline_s=WAIT_S)
            conn.send("sent")
        else:
            got = await received(t, min_version=1, deadline_s=WAIT_S)
            conn.send(("got", same_as({n: x.cpu() for n, x in got.items()}, 1)))
    finally:
        await t.close()
