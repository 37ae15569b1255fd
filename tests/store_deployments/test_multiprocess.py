"""The multiprocess deployment: the conformance suite, the model check, and cross-process behaviour."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import stat

import pytest
import torch
from asyncflow_spec import StoreSpec
from asyncflow_spec.base import run
from asyncflow_spec.store import make_store_state_machine

from asyncflow_core.store.deployments.channel import ChannelClient, ChannelError
from asyncflow_core.store.deployments.multiprocess import MultiprocessStore
from asyncflow_core.store.errors import ColumnTypeError, InvalidRequestError, LeaseError, UnknownColumnError
from asyncflow_core.types import RaggedTensor


class TestMultiprocessStore(StoreSpec):
    backend = "multiprocess"
    options = {"arena_mb": 16}
    fake_clock = False  # the controller runs on the server's clock


def _create(*, capacity: int, lease_s: float, clock=None):
    from asyncflow_core.plugins import get_plugin_manager

    return get_plugin_manager().create("store", "multiprocess", {"capacity": capacity, "lease_s": lease_s, "arena_mb": 8})


TestMultiprocessMachine = make_store_state_machine(_create, max_examples=15, fake_clock=False).TestCase


# ---------------------------------------------------------------- helpers run in child processes


def _consumer(address: str, token: str, out: mp.Queue) -> None:
    async def go():
        store = MultiprocessStore(address, token)
        meta = await store.get_meta("train", ["ids", "lp"], 3, timeout=30)
        batch = await store.get(meta)
        out.put((meta.row_ids.tolist(), batch["ids"].to_list(), batch["lp"].values.sum().item()))
        await store.ack(meta)
        await store.close()

    asyncio.run(go())


def _dying_consumer(address: str, token: str, out) -> None:
    async def go():
        store = MultiprocessStore(address, token)
        meta = await store.get_meta("train", ["ids"], 2, timeout=30)
        out.send(meta.row_ids.tolist())  # a pipe send completes before returning, unlike a queue's
        os._exit(3)  # crash while holding the lease: no ack, no close

    asyncio.run(go())


def _ctx():
    return mp.get_context("spawn")


# ---------------------------------------------------------------- tests


def test_consumer_in_another_process_reads_rows_a_producer_wrote():
    """A spawned process leases, reads (through shared memory) and acknowledges rows this process put."""

    async def go():
        store = MultiprocessStore.serve(arena_mb=16)
        await store.register_task("gen", produces=["ids", "lp"])
        await store.register_task("train", consumes=["ids", "lp"])
        q = _ctx().Queue()
        proc = _ctx().Process(target=_consumer, args=(store.address, store.token, q))
        proc.start()
        ids = RaggedTensor.from_sequences([[1, 2, 3], [4], [5, 6]])
        lp = RaggedTensor.from_sequences([[0.5, 0.5, 1.0], [2.0], [3.0, 4.0]], dtype=torch.float32)
        put = await store.put({"ids": ids, "lp": lp})
        rows, got, lp_sum = await asyncio.to_thread(q.get, True, 60)
        await asyncio.to_thread(proc.join, 60)
        assert proc.exitcode == 0
        assert rows == put.row_ids.tolist() and got == [[1, 2, 3], [4], [5, 6]] and lp_sum == 11.0
        stats = await store.stats()
        assert stats["rows_live"] == 0 and stats["bytes_stored"] == 0  # collected and its shared memory freed
        await store.close()

    run(go())


def test_leases_of_a_dead_consumer_process_come_back():
    """A consumer process that dies holding a lease loses no rows: the server frees its leases on disconnect."""

    async def go():
        store = MultiprocessStore.serve(arena_mb=16)
        await store.register_task("gen", produces=["ids"])
        await store.register_task("train", consumes=["ids"])
        await store.put({"ids": RaggedTensor.from_sequences([[1], [2]])})
        parent, child = _ctx().Pipe(duplex=False)
        proc = _ctx().Process(target=_dying_consumer, args=(store.address, store.token, child))
        proc.start()
        assert await asyncio.to_thread(parent.poll, 60)
        leased = parent.recv()
        await asyncio.to_thread(proc.join, 60)
        assert proc.exitcode == 3
        meta = await store.get_meta("train", ["ids"], 2, timeout=30)  # wakes when the server frees the lease
        assert sorted(meta.row_ids.tolist()) == sorted(leased)
        await store.close()

    run(go())


def test_bad_input_gives_typed_errors():
    async def go():
        store = MultiprocessStore.serve(arena_mb=4)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        await store.put({"x": torch.zeros(2, dtype=torch.float32)})
        with pytest.raises(ColumnTypeError):
            await store.put({"x": torch.zeros(2, dtype=torch.int64)})  # dtype differs from the first write
        with pytest.raises(ColumnTypeError):
            await store.put({"x": [1, 2]})  # type: ignore[dict-item]
        with pytest.raises(UnknownColumnError):
            await store.get_meta("train", ["nope"], 1, timeout=1)
        with pytest.raises(InvalidRequestError):
            await store.put({"x": torch.zeros(8 << 20, dtype=torch.float32)})  # larger than the whole arena
        meta = await store.get_meta("train", ["x"], 2, timeout=5)
        await store.ack(meta)
        with pytest.raises(LeaseError):
            await store.ack(meta)
        stats = await store.stats()
        assert stats["rows_put"] == 1 * 2 and stats["bytes_stored"] == 0
        await store.close()

    run(go())


def test_channel_is_private_and_refuses_a_wrong_token():
    async def go():
        store = MultiprocessStore.serve(arena_mb=1)
        await store.stats()
        directory = os.path.dirname(store.address)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(store.address).st_mode) == 0o600
        with pytest.raises(ChannelError):
            await ChannelClient(store.address, "not-the-token").connect()
        # a peer that sends garbage instead of the handshake is dropped without its bytes being decoded
        reader, writer = await asyncio.open_unix_connection(store.address)
        await reader.readexactly(32)
        writer.write(b"\x80\x04garbage" * 8)
        assert await reader.read() == b""
        writer.close()
        assert (await store.stats())["rows_live"] == 0  # the server is unharmed
        await store.close()

    run(go())


def test_zero_copy_views_keep_their_range_until_dropped():
    """Rows read back to back come as views; their shared memory is not reused while a view is alive."""

    async def go():
        store = MultiprocessStore.serve(arena_mb=1)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        await store.put({"x": torch.arange(1000, dtype=torch.int64)})
        meta = await store.get_meta("train", ["x"], 1000, timeout=5)
        view = (await store.get(meta))["x"]
        await store.ack(meta)  # rows collected, but the view still pins the range
        await store.put({"x": torch.full((1000,), -1, dtype=torch.int64)})
        assert view.tolist() == list(range(1000))
        del view
        await store.close()

    run(go())


def test_a_new_server_directory_removes_those_of_killed_servers_and_keeps_live_ones(tmp_path):
    """A killed server cannot remove its directory (socket + arena, on tmpfs its touched pages stay in memory):
    the next one removes this user's directories whose process is gone, and no other."""
    import subprocess
    import sys

    from asyncflow_core.store.deployments.channel import private_dir, sweep_dead_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer exists (reaped)
    dead = tmp_path / f"asyncflow-store-{gone.pid}-abc"
    live = tmp_path / f"asyncflow-store-{os.getpid()}-def"
    other = tmp_path / "asyncflow-store-lane-xyz"  # not a server directory's name
    for d in (dead, live, other):
        d.mkdir()
        (d / "arena").write_bytes(b"x" * 64)
    assert sweep_dead_dirs(str(tmp_path), "asyncflow-store-") == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()
    mine = private_dir()
    try:
        assert os.path.basename(mine).startswith(f"asyncflow-store-{os.getpid()}-")
    finally:
        os.rmdir(mine)
