"""The ray deployment: the conformance suite, the model check, joining by name, and consumers in Ray workers."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray store needs Ray: pip install 'asyncflow[ray]'")

from asyncflow_spec import StoreSpec  # noqa: E402
from asyncflow_spec.base import run  # noqa: E402
from asyncflow_spec.store import make_store_state_machine  # noqa: E402

from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.store.deployments.ray_store import (  # noqa: E402
    RayStore,
    init_local_ray,
    ray_listening_addresses,
)
from asyncflow_core.store.errors import ColumnTypeError, LeaseError, StoreClosedError, UnknownColumnError  # noqa: E402
from asyncflow_core.types import RaggedTensor  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One loopback-only Ray for the module (started here unless the session already has one)."""
    started = not ray.is_initialized()
    init_local_ray()
    yield
    for store in _next_store.values():
        run(store.close())
    _next_store.clear()
    if started:
        ray.shutdown()


# Each store boots two actor processes, and each imports torch (about 2 s of CPU here): the factories below
# start making the next store of the common shape while the current test runs.
_next_store: dict[tuple, RayStore] = {}


def _make(**options) -> RayStore:
    from asyncflow_core.plugins import get_plugin_manager

    return get_plugin_manager().create("store", "ray", options)


def _prefetched(**options) -> RayStore:
    key = tuple(sorted(options.items()))
    store = _next_store.pop(key, None) or _make(**options)
    _next_store[key] = _make(**options)
    return store


class TestRayStore(StoreSpec):
    backend = "ray"
    options = {"num_storage_units": 1}  # several units: test_errors_arrive_typed_and_large_payloads_round_trip
    fake_clock = False  # the controller actor runs on its own clock

    @pytest.fixture
    def make_backend(self):
        def make(**overrides):
            options = {**self.options, **overrides}
            return _prefetched(**options) if options == {**self.options, "capacity": 64, "lease_s": 30.0} else \
                _make(**options)

        return make


def _create(*, capacity: int, lease_s: float, clock=None):
    return _prefetched(capacity=capacity, lease_s=lease_s)


TestRayMachine = make_store_state_machine(_create, max_examples=4, stateful_step_count=8, fake_clock=False).TestCase


# ---------------------------------------------------------------- tests


def test_ray_binds_to_loopback_only():
    """init_local_ray() leaves every Ray server socket on 127.0.0.1 and the node's address loopback."""
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    addresses = ray_listening_addresses()
    assert addresses, "found no listening socket of Ray's processes (is /proc readable?)"
    assert {ip for ip, _, _ in addresses} == {"127.0.0.1"}, addresses


def test_store_without_ray_is_a_config_error(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="ray.init"):
        RayStore(capacity=8)


def test_second_handle_joined_by_name_sees_the_same_rows():
    """A handle joined by actor name leases what the creator put; closing it leaves the store running."""

    async def go():
        owner = RayStore(capacity=16, name="shared-store", namespace="asyncflow-test")
        await owner.register_task("gen", produces=["ids"])
        await owner.register_task("train", consumes=["ids"])
        put = await owner.put({"ids": RaggedTensor.from_sequences([[1, 2], [3]])})
        joined = RayStore.join("shared-store", namespace="asyncflow-test")
        also = RayStore(capacity=1, name="shared-store", namespace="asyncflow-test")  # exists: joins, options unused
        assert not joined.owner and not also.owner and owner.owner
        meta = await joined.get_meta("train", ["ids"], 2, timeout=10)
        assert meta.row_ids.tolist() == put.row_ids.tolist()
        assert (await joined.get(meta))["ids"].to_list() == [[1, 2], [3]]
        await joined.ack(meta)
        await joined.close()
        await also.close()
        with pytest.raises(StoreClosedError):
            await joined.stats()
        assert (await owner.stats())["rows_live"] == 0  # the store outlives its joined handles
        await owner.close()
        with pytest.raises(ConfigError):
            RayStore.join("shared-store", namespace="asyncflow-test")  # the creator's close killed the actors

    run(go())


@ray.remote(num_cpus=1)
def _consume(store: RayStore) -> tuple[list[int], list[list[int]], float]:
    async def go():
        meta = await store.get_meta("train", ["ids", "lp"], 3, timeout=30, consumer="ray-task")
        batch = await store.get(meta)
        await store.ack(meta)
        out = meta.row_ids.tolist(), batch["ids"].to_list(), float(batch["lp"].values.sum())
        await store.close()  # a joined handle's close waits for its acks (sent without waiting for their reply)
        return out

    return asyncio.run(go())


def test_consumer_in_a_ray_task_reads_rows_a_producer_wrote():
    """A Ray task (another worker process) blocks in get_meta, then reads and acknowledges rows put here."""

    async def go():
        store = RayStore(capacity=16)
        await store.register_task("gen", produces=["ids", "lp"])
        await store.register_task("train", consumes=["ids", "lp"])
        result = _consume.remote(store)  # the store object arrives there as a joined handle
        await asyncio.sleep(0.5)
        ids = RaggedTensor.from_sequences([[1, 2, 3], [4], [5, 6]])
        lp = RaggedTensor.from_sequences([[0.5, 0.5, 1.0], [2.0], [3.0, 4.0]], dtype=torch.float32)
        put = await store.put({"ids": ids, "lp": lp})
        rows, got, lp_sum = await result
        assert rows == put.row_ids.tolist() and got == [[1, 2, 3], [4], [5, 6]] and lp_sum == 11.0
        stats = await store.stats()
        assert stats["rows_live"] == 0 and stats["bytes_stored"] == 0  # collected, data freed in the units
        await store.close()

    run(go())


def test_errors_arrive_typed_and_large_payloads_round_trip():
    """Actor-side errors come back as the store's own types (not RayTaskError); MB-sized and bf16 columns survive."""

    async def go():
        store = RayStore(capacity=64, num_storage_units=3)
        await store.register_task("gen", produces=["x", "h"])
        await store.register_task("train", consumes=["x", "h"])
        x = torch.randn(40, 8192)  # 1.3 MB: through the object store by reference
        h = RaggedTensor.from_lengths(torch.randn(400, 4).to(torch.bfloat16), torch.full((40,), 10))
        await store.put({"x": x, "h": h})
        with pytest.raises(ColumnTypeError) as err:
            await store.put({"x": torch.zeros(2, 8192, dtype=torch.float64)})
        assert type(err.value) is ColumnTypeError and "first written as dense float32" in str(err.value)
        with pytest.raises(UnknownColumnError):
            await store.get_meta("train", ["nope"], 1, timeout=1)
        meta = await store.get_meta("train", ["x", "h"], 40, timeout=5)
        batch = await store.get(meta)
        order = meta.row_ids  # rows were put as ids 0..39
        assert torch.equal(batch["x"], x[order]) and batch["h"].equal(h.select(order))
        again = await store.get(meta)  # read-only views of the object holding the rows: no copy
        assert again["x"].data_ptr() == batch["x"].data_ptr()
        await store.ack(meta)
        with pytest.raises(LeaseError):
            await store.ack(meta)
        assert (await store.stats())["bytes_stored"] == 0
        await store.close()

    run(go())


def test_expired_lease_returns_on_the_actors_clock():
    """A lease not acknowledged in time comes back to a consumer already blocked in get_meta; the late ack fails."""

    async def go():
        store = _make(capacity=8)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        put = await store.put({"x": torch.tensor([1.0])})
        first = await store.get_meta("train", ["x"], 1, timeout=10, lease_s=0.5, consumer="slow")
        again = await store.get_meta("train", ["x"], 1, timeout=10, consumer="fast")  # waits for the deadline
        assert again.row_ids.tolist() == put.row_ids.tolist() and again.lease_id != first.lease_id
        with pytest.raises(LeaseError):
            await store.ack(first)
        await store.ack(again)
        await store.close()

    run(go())


def test_ack_not_awaited_is_ordered_and_its_error_comes_with_the_next_call():
    """An ack of a lease this handle holds is sent without waiting: the handle's later calls see it applied; when
    it fails after all (another handle declared the consumer dead meanwhile), the next call raises its LeaseError
    and does nothing, and so does close; acks the handle cannot vouch for (a second one, near the deadline) wait."""

    async def go():
        store = _make(capacity=8)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        await store.put({"x": torch.arange(4.0)})
        meta = await store.get_meta("train", ["x"], 2, timeout=10, consumer="w0")
        await store.ack(meta)
        assert store._acks_sent == 1  # noqa: SLF001  (not awaited)
        stats = await store.stats()  # ordered after the ack
        assert stats["rows_live"] == 2 and stats["rows_done"] == 2
        with pytest.raises(LeaseError):
            await store.ack(meta)  # a second ack: this handle knows it ended, so it waits and raises at once
        assert store._acks_sent == 1  # noqa: SLF001

        other = RayStore._from_handle(store._controller, None, None)  # noqa: SLF001  (a second handle)
        late = await store.get_meta("train", ["x"], 1, timeout=10, consumer="w1")
        assert await other.declare_dead("w1") == 1
        await store.ack(late)  # the handle cannot know: sent without waiting, fails at the controller
        with pytest.raises(LeaseError, match="earlier ack on this store handle failed"):
            await store.put({"x": torch.tensor([9.0])})
        assert (await store.stats())["rows_live"] == 2  # that put did nothing; the error was raised once

        again = await store.get_meta("train", ["x"], 1, timeout=10, consumer="w2")
        await other.declare_dead("w2")
        await store.ack(again)
        with pytest.raises(LeaseError, match="earlier ack on this store handle failed"):
            await store.close()  # the last word of a handle reports it too; the store is closed all the same
        with pytest.raises(StoreClosedError):
            await other.stats()

    run(go())


@ray.remote(num_cpus=0)
class _Producer:
    def put(self, store: RayStore, x: torch.Tensor, arena: bool) -> tuple[list[int], list]:
        from asyncflow_core.store.deployments import ray_arena

        if not arena:
            ray_arena.ARENA_MAX_BYTES = 0  # this process puts through Ray's object store

        async def go():
            return (await store.put({"x": x})).row_ids.tolist()

        probe = ray.put(torch.zeros(1 << 16).numpy())  # an object of this process, to see when Ray drops them
        return asyncio.run(go()), [probe]


@pytest.mark.parametrize("arena", [False, True], ids=["object-store", "arena"])
def test_rows_outlive_the_process_that_put_them(arena):
    """A put's object belongs to its producer, and Ray drops it when the producer exits: the storage unit that
    pinned it at the put serves it to readers from then on. An arena put's file outlives its producer."""

    async def go():
        store = RayStore(capacity=64)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        x = torch.arange(40 * 8192, dtype=torch.float32).reshape(40, 8192)  # 1.3 MB: by reference, not inline
        producer = _Producer.remote()
        rows, (probe,) = await producer.put.remote(store, x, arena)
        ray.kill(producer, no_restart=True)
        for _ in range(600):  # until Ray has dropped the producer's objects (it learns of the exit asynchronously)
            try:
                await probe
            except ray.exceptions.ObjectLostError:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("Ray kept the objects of a killed producer for 30 s")
        meta = await store.get_meta("train", ["x"], 40, timeout=10)
        assert meta.row_ids.tolist() == rows
        located = await store._controller.locate.remote(meta.row_ids.numpy(), ["x"])  # noqa: SLF001
        (where,) = located["objects"].values()
        assert isinstance(where, dict) == arena  # an arena range is described by a dict, an object by its ref
        if arena:
            await store._controller.unpin_ranges.remote([(where["arena"], where["seq"])])  # noqa: SLF001
        assert torch.equal((await store.get(meta))["x"], x)
        await store.ack(meta)
        assert (await store.stats())["bytes_stored"] == 0
        await store.close()

    run(go())


# ---------------------------------------------------------------- the same-node arena path


def test_arena_batch_keeps_its_values_while_the_producer_recycles_ranges():
    """A large put goes through the producer's shared-memory arena, a get returns views of it; a batch kept after
    its ack pins its range, so later puts (which recycle freed ranges) never write under it; once the batch is
    dropped the range is recycled; a reader on "another node" reads through the storage unit; close removes the
    files."""
    from asyncflow_core.store.deployments import ray_arena

    async def go():
        store = RayStore(capacity=64)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])

        async def put_get_ack(value: float, keep: bool):
            await store.put({"x": torch.full((8, 8192), value)})  # 256 KiB: above the inline size
            meta = await store.get_meta("train", ["x"], 8, timeout=10)
            batch = await store.get(meta)
            await store.ack(meta)
            return batch if keep else None

        kept = await put_get_ack(1.0, keep=True)
        assert store._arena is not None and len(store._arena.files) == 1  # noqa: SLF001
        arena_dir = store._arena.dir  # noqa: SLF001
        (mapped,) = store._reader._maps.values()  # noqa: SLF001  (this reader's mapping of the producer's file)
        assert kept["x"].data_ptr() == mapped.bytes.data_ptr() + ray_arena.HEADER  # a view, no copy
        for v in range(2, 8):
            await put_get_ack(float(v), keep=False)
        assert bool((kept["x"] == 1.0).all())  # its range was never recycled while the batch lived
        used = store._arena.files[0][2].used  # noqa: SLF001
        del kept
        for v in range(8, 11):  # the unpin travels with the next calls; the range comes back with a put reply
            await put_get_ack(float(v), keep=False)
        assert store._arena.files[0][2].used < used  # noqa: SLF001

        await store.put({"x": torch.full((8, 8192), 11.0)})
        meta = await store.get_meta("train", ["x"], 8, timeout=10)
        store._node = "another-node"  # noqa: SLF001  (this handle now reads as if from elsewhere: via the unit)
        far = await store.get(meta)
        base, size = mapped.bytes.data_ptr(), mapped.nbytes
        assert bool((far["x"] == 11.0).all()) and not base <= far["x"].data_ptr() < base + size  # the unit's copy
        await store.ack(meta)
        assert (await store.stats())["bytes_stored"] == 0
        await store.close()
        assert not os.path.exists(arena_dir)

    run(go())


def test_get_reads_where_get_meta_found_the_rows_unless_a_value_changed_since():
    """get_meta answers with the rows' locations; a get on the controller's node reads them without asking again,
    unless a value was replaced or freed meanwhile (the controller's epoch in shared memory moved): then it
    locates again and reads the new value. A meta dropped unread releases its range for recycling."""

    async def go():
        store = RayStore(capacity=64)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        calls = []
        ctl = store._ctl  # noqa: SLF001

        async def counting(method, *args):
            calls.append(method)
            return await ctl(method, *args)

        store._ctl = counting  # noqa: SLF001
        for value in (1.0, 2.0):
            await store.put({"x": torch.full((8, 8192), value)})  # 256 KiB: through the arena
            meta = await store.get_meta("train", ["x"], 8, timeout=10)
            calls.clear()
            assert bool(((await store.get(meta))["x"] == value).all())
            assert "locate" not in calls  # read where get_meta found it
            assert bool(((await store.get(meta))["x"] == value).all()) and calls == ["locate"]  # (taken once)
            await store.ack(meta)

        await store.put({"x": torch.full((8, 8192), 3.0)})
        meta = await store.get_meta("train", ["x"], 8, timeout=10)
        other = RayStore._from_handle(store._controller, None, None)  # noqa: SLF001
        await other.put({"x": torch.full((8, 8192), 4.0)}, rows=meta)  # the leased rows' value replaced
        calls.clear()
        assert bool(((await store.get(meta))["x"] == 4.0).all()) and calls == ["locate"]
        await store.ack(meta)

        await store.put({"x": torch.full((8, 8192), 5.0)})
        meta = await store.get_meta("train", ["x"], 8, timeout=10)
        await store.ack(meta)
        used = store._arena.files[0][2].used  # noqa: SLF001
        del meta  # never read: its pin goes with the next call, the range comes back with the put's reply
        await store.put({"x": torch.full((8, 8192), 6.0)})
        assert store._arena.files[0][2].used <= used  # noqa: SLF001  (6.0's range replaced 5.0's)
        await store.close()

    run(go())


def test_without_a_storage_unit_on_the_node_puts_go_through_rays_object_store():
    async def go():
        store = RayStore(capacity=16)
        store._node = "a-node-without-units"  # noqa: SLF001
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        x = torch.randn(8, 8192)
        await store.put({"x": x})
        assert store._arena is None  # noqa: SLF001
        meta = await store.get_meta("train", ["x"], 8, timeout=10)
        assert torch.equal((await store.get(meta))["x"], x)
        await store.ack(meta)
        await store.close()

    run(go())


def test_arena_ranges_round_trip_and_a_recycled_range_is_detected(tmp_path, monkeypatch):
    """Writer and reader of one range (bf16 as raw bytes, an empty column); a range rewritten by a later put
    fails the reader's header check; with no shared-memory directory the arena says so once and takes nothing."""
    import numpy as np

    from asyncflow_core.store.deployments import ray_arena
    from asyncflow_core.store.deployments.ray_store import _column_to_wire

    monkeypatch.setattr(ray_arena, "SHM_ROOT", str(tmp_path))
    monkeypatch.setattr(ray_arena, "ARENA_FILE_MIN_BYTES", 1 << 16)
    arena, reader = ray_arena.ProducerArena("test", "node", 0, os.getpid()), ray_arena.ArenaReader()
    h = torch.randn(3, 5).to(torch.bfloat16)
    ids = RaggedTensor.from_sequences([[1, 2], [], [3]])
    wire = {"h": _column_to_wire(h), "ids": _column_to_wire(ids), "e": _column_to_wire(torch.zeros(0, 4))}
    desc = arena.place(wire)
    arena.fill(desc, wire)
    got = reader.read(desc)
    assert torch.equal(got["h"]["v"], h) and got["e"]["v"].shape == (0, 4)
    assert RaggedTensor(got["ids"]["v"], got["ids"]["o"]).to_list() == [[1, 2], [], [3]]
    arena.release(desc)
    again = arena.place(wire)  # the freed range is reused ...
    assert (again["file"], again["offset"]) == (desc["file"], desc["offset"])
    arena.fill(again, wire)
    with pytest.raises(ray_arena.RangeRecycledError):  # ... and a reader of the old put sees it
        reader.read(desc)

    monkeypatch.setattr(ray_arena, "SHM_ROOT", str(tmp_path / "missing"))
    none = ray_arena.ProducerArena("test", "node", 0, os.getpid())
    with pytest.warns(RuntimeWarning, match="no shared-memory arena") as caught:
        assert none.place(wire) is None and none.place({"x": {"v": (np.ones(1), None, (1,))}}) is None
    assert len(caught) == 1 and not (tmp_path / "missing").exists()


def test_arena_directories_of_a_killed_store_are_swept(tmp_path, monkeypatch):
    """A store killed outright (no close) leaves its arena directory; the next unit on the host removes it once the
    unit that named it is gone, and never a live unit's."""
    import subprocess
    import sys

    from asyncflow_core.store.deployments import ray_arena
    from asyncflow_core.store.deployments.ray_store import _column_to_wire

    monkeypatch.setattr(ray_arena, "SHM_ROOT", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(gone.stdout)
    dead = ray_arena.ProducerArena("killed", "node", 0, dead_pid)
    live = ray_arena.ProducerArena("running", "node", 0, os.getpid())
    wire = {"x": _column_to_wire(torch.ones(4))}
    for arena in (dead, live):
        arena.fill(arena.place(wire), wire)
    assert os.path.isdir(dead.dir) and os.path.isdir(live.dir)
    assert ray_arena.sweep_dead_arenas() == [dead.dir]
    assert not os.path.exists(dead.dir) and os.path.isdir(live.dir)
