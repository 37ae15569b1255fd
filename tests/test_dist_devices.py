"""CPU checks of the NCCL paths of the ``dist`` transport and the ``distributed`` store.

What needs no GPU runs for real: the device choice per rank and per thread,
the option plumbing into torch (group timeout, ``device_id``), the waits that
give up on a dead NCCL peer, and the store's lane protocol (one process group
per client rank, formed on request, replaced when given up), run over gloo
pair groups between spawned processes.

This machine has no CUDA and no NCCL, so where a test needs them it uses
stand-ins, and says so: :class:`FakeCuda` (a per-thread current device, as
CUDA has; a new thread is on device 0), :class:`FakeNcclGroup` (records the
thread, device and options it was built with) and :class:`FakeWork` (an
NCCL work whose end event fires when told). The same paths on real GPUs are
in ``tests/test_dist_gpu.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import threading
import traceback
from datetime import timedelta
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from asyncflow_spec.base import run

from asyncflow_core.errors import ConfigError, WeightTransferError
from asyncflow_core.store.deployments import distributed as dstore
from asyncflow_core.store.deployments.config import DistributedStoreConfig
from asyncflow_core.store.deployments.nccl_support import (
    resolve_cuda_device,
    select_cuda_device,
    settle,
    use_device,
    watchdog_timeout_s,
)
from asyncflow_core.store.deployments.p2p import Lane, P2PLink, memory_in_use
from asyncflow_core.store.errors import StoreClosedError, StoreTimeoutError
from asyncflow_core.types import pack_buckets
from asyncflow_plugins.weight_transports.config import DistTransportConfig
from asyncflow_plugins.weight_transports.dist import DistWeightTransport

WAIT_S = 60


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


# ================================================================== stand-ins for CUDA / NCCL


class FakeCuda:
    """Stands in for ``torch.cuda`` (no GPU here): ``count`` devices and a current device *per thread*, 0 in a
    thread that never set one, which is what CUDA does and what made every helper thread land on ``cuda:0``."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._local = threading.local()
        self.synchronized: list[torch.device] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.synchronized.append(device))
        return self

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, device: int | str | torch.device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        assert index is not None and 0 <= index < self.count, f"set_device({device!r}) outside the fake's devices"
        self._local.index = index


class FakeNcclGroup:
    """Stands in for ``torch.distributed.ProcessGroupNCCL`` (no NCCL here): records where and how it was built."""

    built: ClassVar[list[FakeNcclGroup]] = []

    class Options:
        def __init__(self) -> None:
            self._timeout: timedelta | None = None
            self.group_name = ""

    def __init__(self, store, rank: int, size: int, options: FakeNcclGroup.Options) -> None:
        self.rank, self.size, self.options = rank, size, options
        self.thread = threading.current_thread()
        self.thread_device = torch.cuda.current_device()
        self.connected: torch.device | None = None
        self.timeouts: list[timedelta] = []
        self.aborted = self.shut_down = False
        FakeNcclGroup.built.append(self)

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.connected = device

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeouts.append(timeout)

    def abort(self) -> None:
        self.aborted = True

    def shutdown(self) -> None:
        self.shut_down = True


class FakeWork:
    """Stands in for an NCCL work (no CUDA here): ``is_completed`` is its end event, set when the kernel ends."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.waited = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited = True
        return True


class FakeLaneGroup:
    """Stands in for a lane's ProcessGroupNCCL: ``abort()`` either lets the pending kernels exit (what
    ``ncclCommAbort`` does) or, to model a kernel that never exits, leaves the works pending."""

    def __init__(self, works: list[FakeWork], *, kernels_exit: bool) -> None:
        self.works, self.kernels_exit, self.aborted = works, kernels_exit, False

    def abort(self) -> None:
        self.aborted = True
        if self.kernels_exit:
            for w in self.works:
                w.done = True


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return FakeCuda(2).install(monkeypatch)


@pytest.fixture
def fake_nccl(monkeypatch):
    FakeNcclGroup.built = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNcclGroup, raising=False)
    return FakeNcclGroup


# ================================================================== device choice (pure)


@pytest.mark.parametrize(
    ("explicit", "local_rank", "current", "count", "want"),
    [
        (None, None, 1, 2, 1),  # the calling thread's device
        (None, "1", 0, 2, 1),  # LOCAL_RANK beats a thread still on its default device 0
        (None, "3", 0, 1, 0),  # one visible device per process (CUDA_VISIBLE_DEVICES): it is cuda:0
        (1, "0", 0, 2, 1),  # an explicit choice beats LOCAL_RANK
        ("cuda:1", None, 0, 2, 1),
        (torch.device("cuda", 0), "1", 1, 2, 0),
        ("cuda", "0", 1, 2, 1),  # "cuda" without an index: the calling thread's device
        (None, " ", 1, 2, 1),  # an empty LOCAL_RANK counts as unset
    ],
)
def test_select_cuda_device(explicit, local_rank, current, count, want):
    assert select_cuda_device(explicit, local_rank=local_rank, current=current, device_count=count) == cuda(want)


@pytest.mark.parametrize(
    ("explicit", "local_rank", "count", "says"),
    [
        (None, None, 0, "sees none"),
        (2, None, 2, "does not exist"),
        ("cpu", None, 2, "not a CUDA device"),
        ("gpu:0", None, 2, "is not a device"),
        (True, None, 2, "must be an index"),
        (None, "x", 2, "is not an integer"),
        (None, "-1", 2, "negative"),
        (None, "2", 2, "sees 2 CUDA devices"),
    ],
)
def test_select_cuda_device_refuses_what_it_cannot_honour(explicit, local_rank, count, says):
    with pytest.raises(ConfigError, match=says):
        select_cuda_device(explicit, local_rank=local_rank, current=0, device_count=count)


def test_the_choice_is_the_calling_threads_not_a_helper_threads(fake_cuda):
    """The bug being fixed: a helper thread's current device is 0, whatever its creator set."""
    fake_cuda.set_device(1)
    chosen = resolve_cuda_device()
    seen: dict[str, int] = {}

    def helper() -> None:
        seen["before"] = torch.cuda.current_device()
        use_device(chosen)
        seen["after"] = torch.cuda.current_device()

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert chosen == cuda(1) and seen == {"before": 0, "after": 1}


# ================================================================== dist transport over (fake) NCCL


async def _one_version(t: DistWeightTransport) -> None:
    buckets = list(pack_buckets([("w", torch.arange(8, dtype=torch.float32))], version=1, bucket_bytes=1024))

    async def items():
        for b in buckets:
            yield b

    await t.send(items(), deadline_s=WAIT_S)  # waits for the group to form; one rank: nothing to broadcast


@pytest.mark.parametrize(("local_rank", "explicit", "thread_device", "want"),
                         [(None, None, 1, 1), ("1", None, 0, 1), ("0", "cuda:1", 0, 1), (None, 0, 1, 0)])
def test_transport_builds_its_nccl_group_on_the_chosen_device(fake_cuda, fake_nccl, monkeypatch, local_rank,
                                                              explicit, thread_device, want):
    """The group is built on the transport's helper thread, on the device chosen in the caller's thread."""
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    fake_cuda.set_device(thread_device)

    async def body() -> DistWeightTransport:
        t = DistWeightTransport(DistTransportConfig(backend="nccl", join_timeout_s=30), device=explicit)
        try:
            await _one_version(t)
        finally:
            await t.close()
        return t

    t = run(body())
    (group,) = fake_nccl.built
    assert t.device == cuda(want)
    assert group.thread is not threading.main_thread() and group.thread_device == want
    assert group.connected == cuda(want)  # formed at once (eager connect), not lazily on another thread
    assert group.options._timeout == timedelta(seconds=watchdog_timeout_s(30))
    assert group.options.group_name and group.shut_down


def test_nccl_receivers_keep_no_buffers(fake_cuda, fake_nccl, monkeypatch):
    """``keep_buffers`` is for gloo: an NCCL receiver gets fresh device memory per version, as before it."""
    monkeypatch.setattr(DistWeightTransport, "_run", lambda self: self._joined.set())  # no group: no rank 0 here
    config = DistTransportConfig(backend="nccl", rank=1, world_size=2, port=_free_port())
    assert config.keep_buffers
    t = DistWeightTransport(config)
    try:
        assert t.device == cuda(0) and t._buffers is None and t.buffer_stats() is None
    finally:
        run(t.close())


def test_transport_refuses_a_device_that_does_not_exist(fake_cuda, fake_nccl):
    with pytest.raises(ConfigError, match="does not exist"):
        DistWeightTransport(DistTransportConfig(backend="nccl"), device=5)
    assert fake_nccl.built == []


def test_transport_aborts_its_nccl_group_when_a_broadcast_outlives_its_deadline(fake_cuda, fake_nccl):
    """A dead peer leaves an NCCL broadcast pending: past the deadline the group is aborted, the send fails."""
    import time

    async def body() -> None:
        t = DistWeightTransport(DistTransportConfig(backend="nccl", join_timeout_s=30))
        try:
            await _one_version(t)  # the group has formed
            group = t._group
            assert group is not None
            group.bound_transfer(time.monotonic() + 7.0)
            assert group.pg.timeouts[-1] >= timedelta(seconds=watchdog_timeout_s(6.0))  # past the deadline
            done = FakeWork(done=True)
            group.finish([done], time.monotonic() + WAIT_S, "a finished broadcast")
            assert done.waited and fake_cuda.synchronized == [group.device] and not group.pg.aborted
            with pytest.raises(WeightTransferError, match="NCCL group was aborted"):
                group.finish([FakeWork(done=False)], time.monotonic(), "the broadcast of version 2")
            assert group.pg.aborted
        finally:
            await t.close()

    run(body())


# ================================================================== distributed store: devices and init


def test_data_plane_device(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dstore.data_plane_device("gloo") == torch.device("cpu")
    assert dstore.data_plane_device("nccl") == cuda(1)
    assert dstore.data_plane_device("cpu:gloo,cuda:nccl", "cuda:0") == cuda(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("local_rank", "explicit", "want"), [("1", None, 1), ("1", 0, 0), (None, None, 0)])
def test_loopback_nccl_group_sets_and_binds_the_device_before_it_forms(fake_cuda, monkeypatch, local_rank,
                                                                        explicit, want):
    """``init_process_group`` (a recording stand-in: no NCCL here) gets ``device_id`` and is called with that
    device already current in the calling thread."""
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    calls: list[dict] = []

    def fake_init(backend, **kw):
        calls.append({"backend": backend, "current": torch.cuda.current_device(), **kw})

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    before = os.environ.pop("NCCL_SOCKET_IFNAME", None)
    try:
        got = dstore.init_loopback_process_group(0, 1, _free_port(), backend="nccl", timeout_s=5, device=explicit)
        nccl_ifname = os.environ.get("NCCL_SOCKET_IFNAME")
    finally:
        os.environ.pop("NCCL_SOCKET_IFNAME", None)
        if before is not None:
            os.environ["NCCL_SOCKET_IFNAME"] = before
    (call,) = calls
    assert got == call["device_id"] == cuda(want) and call["current"] == want and call["backend"] == "nccl"
    assert call["timeout"] == timedelta(seconds=5)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        assert nccl_ifname == "lo"  # NCCL's bootstrap sockets stay on loopback, like the rendezvous


def test_loopback_gloo_group_gets_no_device(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(kw))
    assert dstore.init_loopback_process_group(0, 1, _free_port(), timeout_s=5) == torch.device("cpu")
    assert calls[0]["device_id"] is None


# ================================================================== lane waits (fake NCCL works)


def _polling_lane(group) -> Lane:
    lane = Lane(peer=1, gen=1, key="k/", pair_rank=0, group=group, polls=True)
    lane.formed.set_result(None)
    return lane


def test_settle_polls_until_complete_or_deadline():
    """Deterministic: a stand-in clock and pause; the works complete on the third look."""
    now = [0.0]
    looks = [0]

    class Slow(FakeWork):
        def is_completed(self) -> bool:
            looks[0] += 1
            return looks[0] >= 3

    def pause(dt: float) -> None:
        now[0] += dt

    assert settle([Slow()], end=10.0, clock=lambda: now[0], pause=pause) is True
    assert settle([FakeWork(done=False)], end=now[0] + 0.1, clock=lambda: now[0], pause=pause) is False
    assert now[0] >= 0.1


@pytest.mark.parametrize("kernels_exit", [True, False])
def test_a_wait_past_its_deadline_aborts_the_lane_never_the_process(kernels_exit):
    works = [FakeWork(done=False)]
    group = FakeLaneGroup(works, kernels_exit=kernels_exit)
    link = P2PLink(None, torch.device("cpu"), pair_groups=True)
    lane = _polling_lane(group)

    async def body() -> BaseException:
        with pytest.raises(StoreTimeoutError, match="lane was aborted") as info:
            await link.wait(works, lane, timeout_s=0.05)
        return info.value

    err = run(body())
    assert group.aborted and lane.aborted and lane.broken is not None
    assert memory_in_use(err) is (not kernels_exit)  # reuse buffers only once the receive is seen to end
    with pytest.raises(StoreClosedError, match="unusable"):
        link._issue(lane, [("recv", torch.empty(1), 0)])  # nothing new goes onto a broken lane
    link.shutdown()


def test_a_completed_wait_on_a_healthy_lane_orders_the_stream_and_returns():
    works = [FakeWork(done=True), FakeWork(done=True)]
    link = P2PLink(None, torch.device("cpu"), pair_groups=True)
    lane = _polling_lane(FakeLaneGroup(works, kernels_exit=True))
    run(link.wait(works, lane, timeout_s=5))
    assert all(w.waited for w in works) and not lane.group.aborted
    lane.broken = "another transfer on it timed out"  # its works ended because the lane was aborted: not whole
    with pytest.raises(StoreClosedError, match="given up"):
        run(link.wait([FakeWork(done=True)], lane, timeout_s=5))
    link.shutdown()


@pytest.mark.parametrize(("done", "kernels_exit", "ended", "aborted"),
                         [(True, True, True, False), (False, True, True, True), (False, False, False, True)])
def test_a_gone_peers_transfer_is_abandoned_by_abort_not_by_a_failing_receive(done, kernels_exit, ended, aborted):
    works = [FakeWork(done=done)]
    group = FakeLaneGroup(works, kernels_exit=kernels_exit)
    link = P2PLink(None, torch.device("cpu"), pair_groups=True)
    lane = _polling_lane(group)
    assert run(link.settle_or_abort(works, lane, grace_s=0.05)) is ended
    assert group.aborted is aborted and (lane.broken is not None) is aborted
    link.shutdown()


# ================================================================== the lane protocol, for real over gloo pairs


def _ctx():
    return mp.get_context("spawn")


def _init(port: int, rank: int, world: int) -> None:
    dstore.init_loopback_process_group(rank, world, port, timeout_s=WAIT_S)


def _lane_server(port: int, world: int, arena_mb: int, conn) -> None:
    """Rank 0: host with one process group per client lane (gloo pairs on the CPU) until told to stop."""
    os.environ["OMP_NUM_THREADS"] = "1"
    _init(port, 0, world)
    host = dstore.DistributedHost.start(DistributedStoreConfig(arena_mb=arena_mb, timeout_s=WAIT_S), pair_groups=True)
    conn.send("ready")
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    host.stop()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _lane_client(port: int, world: int, rank: int, role: str, conn) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _init(port, rank, world)
    try:
        store = dstore.DistributedStore(DistributedStoreConfig(name="lanes", arena_mb=1, timeout_s=WAIT_S))
        asyncio.run(_LANE_ROLES[role](store, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


async def _round_trips(store, conn) -> None:
    """Put and get over a lane; then give the lane up on this side: the next put forms lane 2 and works."""
    await store.register_task("gen", produces=["x"])
    await store.register_task("train", consumes=["x"])
    x = torch.arange(70_000, dtype=torch.float32).reshape(2, 35_000)  # one message above the pack limit
    await store.put({"x": x})
    meta = await store.get_meta("train", ["x"], 2, timeout=WAIT_S)
    got = (await store.get(meta))["x"]
    lane = store.link.client_lane(0)
    first = (lane.gen, lane.group is not None, torch.equal(got, x))
    await store.ack(meta)
    store.link.abort_later(lane, "given up by the test")
    await store.put({"x": x + 1})
    meta = await store.get_meta("train", ["x"], 2, timeout=WAIT_S)
    got = (await store.get(meta))["x"]
    conn.send(("done", first, (store.link.client_lane(0).gen, torch.equal(got, x + 1))))
    await store.ack(meta)
    await store.close()


async def _dies_with_a_posted_receive(store, conn) -> None:
    """Put 700 KB of a 1 MiB arena, but die right after the server posted its receive, before sending."""
    await store.register_task("gen", produces=["x"])

    def die(*args, **kwargs):
        os._exit(3)

    store.link.post_at = die
    await store.put({"x": torch.zeros(1, 175_000, dtype=torch.float32)})


async def _needs_the_dead_ranks_arena(store, conn) -> None:
    conn.recv()  # the other client died
    await store.register_task("gen", produces=["x"])
    meta = await store.put({"x": torch.ones(1, 175_000, dtype=torch.float32)}, timeout=WAIT_S)  # waits for room
    conn.send(("put", len(meta)))
    await store.close()


_LANE_ROLES = {"round_trips": _round_trips, "dies": _dies_with_a_posted_receive,
               "needs_room": _needs_the_dead_ranks_arena}


def _recv(pipe, what: str):
    if not pipe.poll(WAIT_S):
        pytest.fail(f"no answer from a spawned rank while waiting for {what}")
    msg = pipe.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        pytest.fail(f"a spawned rank failed while waiting for {what}:\n{msg[1]}")
    return msg


class _Ranks:
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


def test_lanes_form_on_request_carry_transfers_and_are_replaced_when_given_up():
    ranks, port = _Ranks(), _free_port()
    try:
        server = ranks.spawn(_lane_server, port, 2, 16)
        client = ranks.spawn(_lane_client, port, 2, 1, "round_trips")
        assert _recv(server, "the server") == "ready"
        kind, first, second = _recv(client, "the round trips")
        assert kind == "done"
        assert first == (1, True, True)  # lane 1: its own pair group, bytes intact
        assert second == (2, True)  # the given-up lane was replaced by lane 2, which carries the next transfers
    finally:
        ranks.stop()


def test_a_client_that_dies_with_a_posted_receive_gives_its_arena_back():
    """Rank 1 dies after the server posted a receive for its 700 KB put; rank 2 then needs that room."""
    ranks, port = _Ranks(), _free_port()
    try:
        server = ranks.spawn(_lane_server, port, 3, 1)
        ranks.spawn(_lane_client, port, 3, 1, "dies")
        survivor = ranks.spawn(_lane_client, port, 3, 2, "needs_room")
        assert _recv(server, "the server") == "ready"
        ranks.procs[1].join(timeout=WAIT_S)
        assert ranks.procs[1].exitcode == 3
        survivor.send("it died")
        assert _recv(survivor, "the survivor's put") == ("put", 1)
    finally:
        ranks.stop()
