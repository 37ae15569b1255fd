"""The NCCL paths of the ``dist`` transport and the ``distributed`` store, on real GPUs (``make test-gpu``).

Each rank is a spawned process that picks its device from ``LOCAL_RANK``
only (nobody calls ``torch.cuda.set_device`` in the test), so a rank that
lands on the wrong device shows up here. Every class needs two CUDA devices
and skips cleanly with fewer; the repository conftest skips the ``gpu``
marker on machines without CUDA. The CPU counterparts (device choice, the
waits that abort, the lane protocol over gloo) are in
``tests/test_dist_devices.py``.

Written against torch 2.13.0 and never run on a GPU so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback

import pytest
import torch

WAIT_S = 120
DEADLINE_S = 5.0  #: the transfer deadline the dead-peer tests give
STORE_TIMEOUT_S = 10.0  #: the store's timeout_s in the dead-peer test (bounds lane forming and the abandon grace)

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices (one per rank)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ctx():
    return mp.get_context("spawn")


def _child(role, rank: int, conn, *args) -> None:
    """A rank: ``LOCAL_RANK`` is its only device hint; failures come back as a traceback."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # NCCL's bootstrap sockets on loopback, like the rendezvous
    try:
        role(rank, conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


class _Ranks:
    def __init__(self) -> None:
        self.procs: list = []
        self.pipes: list = []

    def spawn(self, role, rank: int, *args):
        parent, child = _ctx().Pipe()
        proc = _ctx().Process(target=_child, args=(role, rank, child, *args), daemon=True)
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
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _recv(pipe, what: str, timeout: float = WAIT_S):
    if not pipe.poll(timeout):
        pytest.fail(f"no answer from a spawned rank within {timeout:g}s while waiting for {what}")
    msg = pipe.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        pytest.fail(f"a spawned rank failed while waiting for {what}:\n{msg[1]}")
    return msg


# ====================================================================== dist transport


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + version)
    return [("embed", torch.randn(256, 64, generator=gen)), ("norm", torch.randn(64, generator=gen).bfloat16())]


async def _aiter(items):
    for item in items:
        yield item


def _transport_rank(rank: int, conn, port: int, receiver_dies: bool) -> None:
    """Rank 0 sends version 1 (and, when ``receiver_dies``, version 2 with a short deadline); rank 1 receives.

    With ``receiver_dies`` rank 1 takes version 1 and dies as it is about to take part in version 2's
    broadcast, after committing to it: the broadcast on rank 0 then never ends by itself.
    """
    from asyncflow_core.errors import WeightTransferError
    from asyncflow_core.types import pack_buckets
    from asyncflow_plugins.weight_transports import dist as dist_transport
    from asyncflow_plugins.weight_transports.config import DistTransportConfig

    if receiver_dies and rank == 1:
        original, calls = dist_transport._Group.broadcast, []

        def broadcast(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 1:  # version 1 is one chunk; the next call is version 2's
                os._exit(3)
            return original(self, *args, **kwargs)

        dist_transport._Group.broadcast = broadcast

    async def send(t, version: int, deadline_s: float) -> tuple[str | None, float]:
        cuda = [(n, x.to(t.device)) for n, x in _weights(version)]
        start = time.monotonic()
        try:
            await t.send(_aiter(list(pack_buckets(cuda, version=version, bucket_bytes=1 << 14))),
                         deadline_s=deadline_s)
            return None, time.monotonic() - start
        except WeightTransferError as exc:
            return str(exc), time.monotonic() - start

    async def main() -> None:
        t = dist_transport.DistWeightTransport(DistTransportConfig(rank=rank, world_size=2, port=port,
                                                                   backend="nccl", chunk_mb=0.25))
        try:
            if rank == 0:
                conn.send(("sent", str(t.device), *await send(t, 1, WAIT_S)))
                if receiver_dies:
                    conn.send(("sent", str(t.device), *await send(t, 2, DEADLINE_S)))
            else:
                got = [b async for b in t.receive(min_version=1, deadline_s=WAIT_S)]
                tensors = {n: x for b in got for n, x in b.tensors()}
                want = dict(_weights(1))
                same = tensors.keys() == want.keys() and all(torch.equal(tensors[n].cpu(), x) for n, x in want.items())
                conn.send(("got", str(t.device), sorted({str(b.buffer.device) for b in got}), same))
            with contextlib.suppress(EOFError, OSError):
                conn.recv()
        finally:
            await t.close()

    asyncio.run(main())


@pytest.mark.gpu
@two_gpus
class TestDistTransportOverNccl:
    def test_each_rank_broadcasts_on_its_own_device(self):
        ranks, port = _Ranks(), _free_port()
        try:
            source = ranks.spawn(_transport_rank, 0, port, False)
            receiver = ranks.spawn(_transport_rank, 1, port, False)
            assert _recv(source, "the send")[:3] == ("sent", "cuda:0", None)
            assert _recv(receiver, "the receive") == ("got", "cuda:1", ["cuda:1"], True)
        finally:
            ranks.stop()

    def test_a_peer_that_dies_mid_broadcast_fails_the_send_and_the_source_lives(self):
        """NCCL does not fail a broadcast whose peer died: the source aborts its group at the deadline."""
        ranks, port = _Ranks(), _free_port()
        try:
            source = ranks.spawn(_transport_rank, 0, port, True)
            receiver = ranks.spawn(_transport_rank, 1, port, True)
            assert _recv(source, "version 1")[:3] == ("sent", "cuda:0", None)
            assert _recv(receiver, "version 1 received") == ("got", "cuda:1", ["cuda:1"], True)
            kind, _, error, seconds = _recv(source, "the failed send of version 2")
            assert kind == "sent" and error is not None and "NCCL group was aborted" in error, error
            assert seconds < DEADLINE_S + 60  # the abort itself waits at most the group's timeout
            assert ranks.procs[0].is_alive()
            ranks.procs[1].join(timeout=WAIT_S)
            assert ranks.procs[1].exitcode == 3
        finally:
            ranks.stop()


# ====================================================================== distributed store


def _store_server(rank: int, conn, port: int, arena_mb: int, timeout_s: float) -> None:
    """Rank 0: host the store on its own GPU; for the dead-peer test, also put locally into the arena."""
    import torch.distributed as dist

    from asyncflow_core.store.deployments.config import DistributedStoreConfig
    from asyncflow_core.store.deployments.distributed import (
        DistributedHost,
        DistributedStore,
        init_loopback_process_group,
    )

    device = init_loopback_process_group(rank, 2, port, backend="nccl", timeout_s=WAIT_S)
    config = DistributedStoreConfig(name="gpu", arena_mb=arena_mb, timeout_s=timeout_s)
    host = DistributedHost.start(config)
    conn.send(("ready", str(device), str(host.device), str(host.link.device)))
    msg = conn.recv()
    if msg == "put locally":  # the other rank died holding 700 KB of the 1 MiB arena
        async def put_locally() -> tuple[str, float]:
            store = DistributedStore(config)
            await store.register_task("gen", produces=["x"])
            start = time.monotonic()
            await store.put({"x": torch.ones(1, 175_000, device=store.device)}, timeout=WAIT_S)
            return str(store.device), time.monotonic() - start

        conn.send(("put", *asyncio.run(put_locally())))
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
        os._exit(0)  # the default group lost a rank: skip its teardown (NCCL finalize with a dead peer)
    host.stop()
    dist.destroy_process_group()


def _store_client(rank: int, conn, port: int, role: str) -> None:
    import torch.distributed as dist

    from asyncflow_core.store.deployments.config import DistributedStoreConfig
    from asyncflow_core.store.deployments.distributed import DistributedStore, init_loopback_process_group

    device = init_loopback_process_group(rank, 2, port, backend="nccl", timeout_s=WAIT_S)

    async def round_trip(store) -> None:
        await store.register_task("gen", produces=["x", "ids"])
        await store.register_task("train", consumes=["x", "ids"])
        from asyncflow_core.types import RaggedTensor

        x = torch.arange(3 * 70_000, dtype=torch.float32, device=store.device).reshape(3, 70_000)
        ids = RaggedTensor.from_sequences([[1, 2], [3], [4, 5, 6]])
        put = await store.put({"x": x, "ids": ids})
        want = {int(r): x[i] for i, r in enumerate(put.row_ids.tolist())}
        meta = await store.get_meta("train", ["x", "ids"], 3, timeout=WAIT_S)
        batch = await store.get(meta)
        same = all(torch.equal(batch["x"][i], want[int(r)]) for i, r in enumerate(meta.row_ids.tolist()))
        conn.send(("done", str(device), str(store.device), str(batch["x"].device), same,
                   store.link.client_lane(0).gen))
        await store.ack(meta)
        await store.close()

    async def dies(store) -> None:
        await store.register_task("gen", produces=["x"])
        store.link.post_at = lambda *a, **k: os._exit(3)  # after the server posted its receive, before sending
        await store.put({"x": torch.zeros(1, 175_000, device=store.device)})

    config = DistributedStoreConfig(name="gpu", arena_mb=1, timeout_s=STORE_TIMEOUT_S if role == "dies" else WAIT_S)
    asyncio.run({"round_trip": round_trip, "dies": dies}[role](DistributedStore(config)))
    dist.destroy_process_group()


@pytest.mark.gpu
@two_gpus
class TestDistributedStoreOverNccl:
    def test_put_and_get_between_two_gpus(self):
        ranks, port = _Ranks(), _free_port()
        try:
            server = ranks.spawn(_store_server, 0, port, 16, WAIT_S)
            client = ranks.spawn(_store_client, 1, port, "round_trip")
            assert _recv(server, "the server") == ("ready", "cuda:0", "cuda:0", "cuda:0")
            kind, device, store_device, got_device, same, lane = _recv(client, "the round trip")
            assert (kind, device, store_device, got_device, same) == ("done", "cuda:1", "cuda:1", "cuda:1", True)
            assert lane == 1  # its own NCCL pair group, not the user's default group
        finally:
            ranks.stop()


@pytest.mark.gpu
@two_gpus
class TestDeadNcclPeer:
    def test_a_posted_receive_from_a_dead_rank_is_abandoned_and_the_server_lives(self):
        """Rank 1 dies after the server posted an NCCL receive into 700 KB of its 1 MiB arena. The receive never
        fails; the server aborts that lane's group after its grace, takes the room back (its own put then fits)
        and is still alive after the group's watchdog timeout would have terminated it."""
        from asyncflow_core.store.deployments.distributed import ABANDON_GRACE_S
        from asyncflow_core.store.deployments.nccl_support import watchdog_timeout_s

        ranks, port = _Ranks(), _free_port()
        try:
            server = ranks.spawn(_store_server, 0, port, 1, STORE_TIMEOUT_S)
            ranks.spawn(_store_client, 1, port, "dies")
            assert _recv(server, "the server")[0] == "ready"
            ranks.procs[1].join(timeout=WAIT_S)
            assert ranks.procs[1].exitcode == 3
            server.send("put locally")
            kind, device, seconds = _recv(server, "the server's own put")
            assert (kind, device) == ("put", "cuda:0")
            assert seconds < min(ABANDON_GRACE_S, STORE_TIMEOUT_S) + 60
            # nothing may come back and the process must not end while NCCL's watchdog timeout passes
            window = watchdog_timeout_s(STORE_TIMEOUT_S) + 15
            ranks.procs[0].join(timeout=window)
            assert ranks.procs[0].is_alive(), "the server rank was terminated (NCCL watchdog?)"
        finally:
            ranks.stop()
