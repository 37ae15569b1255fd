"""The distributed deployment: conformance suite and model check from a non-server rank, and multi-rank behaviour.

A module fixture spawns the server rank (rank 0 of a 2-rank gloo group on
127.0.0.1) and this pytest process joins as rank 1, so every column value
of the suite really crosses gloo point to point. The multi-rank tests run
their own 3-rank groups in spawned processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
from asyncflow_spec import StoreSpec
from asyncflow_spec.base import run
from asyncflow_spec.store import make_store_state_machine

from asyncflow_core.store.deployments.config import DistributedStoreConfig
from asyncflow_core.store.errors import ColumnTypeError
from asyncflow_core.types import RaggedTensor

JOIN_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ctx():
    return mp.get_context("spawn")


def _init(port: int, rank: int, world: int) -> None:
    from asyncflow_core.store.deployments.distributed import init_loopback_process_group

    init_loopback_process_group(rank, world, port, timeout_s=JOIN_S)


# ---------------------------------------------------------------- processes


def _server_rank(port: int, world: int, conn) -> None:
    """Rank 0: host the store until the parent says stop (or goes away)."""
    from asyncflow_core.store.deployments.distributed import DistributedHost

    os.environ["OMP_NUM_THREADS"] = "1"
    _init(port, 0, world)
    host = DistributedHost.start(DistributedStoreConfig(arena_mb=64))
    conn.send("ready")
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    host.stop()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _client_rank(port: int, world: int, rank: int, role: str, conn) -> None:
    """A client rank running ``role`` against the server rank; reports to the parent through ``conn``."""
    from asyncflow_core.store.deployments.distributed import DistributedStore

    _init(port, rank, world)
    try:
        asyncio.run(_ROLES[role](DistributedStore(DistributedStoreConfig(name="shared", arena_mb=64)), conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


async def _producer(store, conn) -> None:
    await store.register_task("gen", produces=["ids", "x"])
    await store.register_task("train", consumes=["ids", "x"])
    ids = RaggedTensor.from_sequences([list(range(k)) for k in (3, 1, 100_000)])  # one column above the pack limit
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    put = await store.put({"ids": ids, "x": x})
    conn.send(("put", put.row_ids.tolist()))
    conn.recv()  # the consumer is done
    await store.close()


async def _consumer(store, conn) -> None:
    conn.recv()  # the producer registered the tasks and put
    meta = await store.get_meta("train", ["ids", "x"], 3, timeout=30)  # waits for the producer's put
    batch = await store.get(meta)
    by_row = {int(r): i for i, r in enumerate(meta.row_ids.tolist())}
    conn.send(("got", by_row, batch["ids"].to_list(), batch["x"].tolist()))
    await store.ack(meta)
    await store.close()


async def _leaser_that_dies(store, conn) -> None:
    conn.recv()  # the survivor registered the tasks and put
    meta = await store.get_meta("train", ["ids", "x"], 2, timeout=30)
    await store.get(meta)
    conn.send(("leased", meta.row_ids.tolist()))
    os._exit(3)  # die holding the lease: no ack, no close, no process-group teardown


async def _waits_for_rows_back(store, conn) -> None:
    await store.register_task("gen", produces=["ids", "x"])
    await store.register_task("train", consumes=["ids", "x"])
    put = await store.put({"ids": RaggedTensor.from_sequences([[1], [2]]), "x": torch.zeros(2, 4)})
    conn.send(("put", put.row_ids.tolist()))
    conn.recv()  # the other rank died
    meta = await store.get_meta("train", ["ids", "x"], 2, timeout=30)  # free again once its connection dropped
    batch = await store.get(meta)
    conn.send(("back", meta.row_ids.tolist(), batch["ids"].to_list()))
    await store.ack(meta)
    await store.close()


_ROLES = {"producer": _producer, "consumer": _consumer, "dies": _leaser_that_dies, "survivor": _waits_for_rows_back}


class _World:
    """Spawned ranks of one group; always torn down (terminated if they hang)."""

    def __init__(self) -> None:
        self.procs: list = []
        self.pipes: list = []

    def spawn(self, target, *args):
        parent, child = _ctx().Pipe()
        proc = _ctx().Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        child.close()
        self.procs.append(proc)
        self.pipes.append(parent)
        return parent

    def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(Exception):
                pipe.send("stop")
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _recv(pipe, timeout: float = JOIN_S):
    if not pipe.poll(timeout):
        raise TimeoutError("a spawned rank did not answer in time")
    msg = pipe.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise AssertionError(f"a spawned rank failed:\n{msg[1]}")
    return msg


# ---------------------------------------------------------------- this process as rank 1


@pytest.fixture(scope="module", autouse=True)
def server_rank():
    """Rank 0 hosts the store in a spawned process; this process is rank 1 of the same gloo group."""
    port = _free_port()
    world = _World()
    pipe = world.spawn(_server_rank, port, 2)
    try:
        _init(port, 1, 2)
        try:
            assert _recv(pipe) == "ready"
            yield
        finally:
            dist.destroy_process_group()
    finally:
        world.stop()


class TestDistributedStore(StoreSpec):
    backend = "distributed"
    options = {"arena_mb": 16, "name": None}  # a fresh private instance on the server rank per store
    fake_clock = False  # the controller runs on the server rank's clock


def _create(*, capacity: int, lease_s: float, clock=None):
    from asyncflow_core.plugins import get_plugin_manager

    return get_plugin_manager().create("store", "distributed",
                                       {"capacity": capacity, "lease_s": lease_s, "arena_mb": 8, "name": None})


TestDistributedMachine = make_store_state_machine(_create, max_examples=10, fake_clock=False).TestCase


def test_a_bad_put_changes_nothing_and_the_pair_keeps_working():
    """A put the server refuses (dtype differs from the column's, rows mismatch) moves no bytes, so gloo is fine."""
    from asyncflow_core.store.deployments.distributed import SMALL_COLUMN_BYTES, DistributedStore

    async def go():
        store = DistributedStore(DistributedStoreConfig(name=None, arena_mb=16))
        await store.register_task("gen", produces=["x", "y"])
        await store.register_task("train", consumes=["x", "y"])
        rows = SMALL_COLUMN_BYTES // 4096 + 2  # [rows, 1024] float32 is past the pack limit: its own message
        x = torch.ones(rows, 1024)
        await store.put({"x": x, "y": torch.arange(rows)})
        before = await store.stats()
        with pytest.raises(ColumnTypeError):  # refused by the server at announce time: no receive posted
            await store.put({"x": x.double(), "y": torch.arange(rows)})
        with pytest.raises(ColumnTypeError):  # refused by the client before announcing
            await store.put({"x": x, "y": torch.arange(rows - 1)})
        assert await store.stats() == before
        await store.put({"x": 2 * x, "y": torch.arange(rows)})
        meta = await store.get_meta("train", ["x", "y"], 2 * rows, timeout=10)
        batch = await store.get(meta)
        assert sorted(batch["x"].sum(1).tolist()) == [1024.0] * rows + [2048.0] * rows
        assert torch.equal(torch.sort(batch["y"]).values, torch.arange(rows).repeat_interleave(2))
        await store.ack(meta)
        assert (await store.stats())["bytes_stored"] == 0
        await store.close()

    run(go())


def test_concurrent_puts_and_gets_do_not_cross():
    """Several transfers in flight between the same pair land in the right buffers (tags and issue order)."""
    from asyncflow_core.store.deployments.distributed import DistributedStore

    async def go():
        store = DistributedStore(DistributedStoreConfig(name=None, arena_mb=64))
        await store.register_task("gen", produces=["v"])
        await store.register_task("train", consumes=["v"])
        n = 40  # [40, 1024] int64: past the pack limit
        metas = await asyncio.gather(*[store.put({"v": torch.full((n, 1024), i, dtype=torch.int64)}) for i in range(6)])
        batches = await asyncio.gather(*[store.get(BatchMeta_of(m, "v")) for m in metas])
        for i, b in enumerate(batches):
            assert bool((b["v"] == i).all())
        await store.close()

    run(go())


def BatchMeta_of(meta, column):  # noqa: N802 - reads like the type it builds
    from asyncflow_core.interfaces.store import BatchMeta

    return BatchMeta(row_ids=meta.row_ids, columns=(column,))


# ---------------------------------------------------------------- 3-rank groups


def test_put_on_one_rank_get_on_another():
    """Rank 1 puts, rank 2 leases and reads the same tensors; the server is rank 0."""
    port, world = _free_port(), _World()
    try:
        server = world.spawn(_server_rank, port, 3)
        producer = world.spawn(_client_rank, port, 3, 1, "producer")
        consumer = world.spawn(_client_rank, port, 3, 2, "consumer")
        assert _recv(server) == "ready"
        _, put_rows = _recv(producer)
        consumer.send("go")
        _, by_row, ids, x = _recv(consumer)
        producer.send("done")
        want_ids = {r: list(range(k)) for r, k in zip(put_rows, (3, 1, 100_000), strict=True)}
        want_x = {r: [4.0 * i + j for j in range(4)] for i, r in enumerate(put_rows)}
        assert sorted(by_row) == sorted(put_rows)
        for r, i in by_row.items():
            assert ids[i] == want_ids[r] and x[i] == want_x[r]
    finally:
        world.stop()


def test_rows_leased_by_a_rank_that_dies_come_back():
    """Rank 2 leases and dies holding the lease; rank 1 then leases the same rows."""
    port, world = _free_port(), _World()
    try:
        server = world.spawn(_server_rank, port, 3)
        survivor = world.spawn(_client_rank, port, 3, 1, "survivor")
        dying = world.spawn(_client_rank, port, 3, 2, "dies")
        assert _recv(server) == "ready"
        _, put_rows = _recv(survivor)
        dying.send("go")
        _, leased = _recv(dying)
        world.procs[-1].join(timeout=JOIN_S)
        assert world.procs[-1].exitcode == 3
        survivor.send("it died")
        _, back, ids = _recv(survivor)
        assert sorted(back) == sorted(leased) == sorted(put_rows) and sorted(ids) == [[1], [2]]
    finally:
        world.stop()


def _listening_ports(pid: int) -> list[tuple[str, int]]:
    import subprocess

    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[3]
            host, _, port = local.rpartition(":")
            found.append((host, int(port)))
    return found


def _bind_probe(port: int, out) -> None:
    import os

    from asyncflow_core.store.deployments.distributed import init_loopback_process_group

    init_loopback_process_group(0, 1, port)
    out.send(_listening_ports(os.getpid()))
    dist.destroy_process_group()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss to list listening sockets")
def test_rendezvous_listens_on_loopback_only():
    parent, child = _ctx().Pipe()
    proc = _ctx().Process(target=_bind_probe, args=(_free_port(), child))
    proc.start()
    try:
        assert parent.poll(60)
        ports = parent.recv()
    finally:
        proc.join(timeout=30)
    assert ports, "the rendezvous store should be listening"
    assert all(host in ("127.0.0.1", "[::ffff:127.0.0.1]") for host, _ in ports), ports
