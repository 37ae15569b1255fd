"""The ray deployment: the conformance suite, the model check, joining by name, and consumers in Ray workers."""

from __future__ import annotations

import asyncio

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
        return meta.row_ids.tolist(), batch["ids"].to_list(), float(batch["lp"].values.sum())

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


@ray.remote(num_cpus=0)
class _Producer:
    def put(self, store: RayStore, x: torch.Tensor) -> tuple[list[int], list]:
        async def go():
            return (await store.put({"x": x})).row_ids.tolist()

        probe = ray.put(torch.zeros(1 << 16).numpy())  # an object of this process, to see when Ray drops them
        return asyncio.run(go()), [probe]


def test_rows_outlive_the_process_that_put_them():
    """A put's object belongs to its producer, and Ray drops it when the producer exits: the storage unit that
    pinned it at the put serves it to readers from then on."""

    async def go():
        store = RayStore(capacity=64)
        await store.register_task("gen", produces=["x"])
        await store.register_task("train", consumes=["x"])
        x = torch.arange(40 * 8192, dtype=torch.float32).reshape(40, 8192)  # 1.3 MB: by reference, not inline
        producer = _Producer.remote()
        rows, (probe,) = await producer.put.remote(store, x)
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
        assert torch.equal((await store.get(meta))["x"], x)
        await store.ack(meta)
        assert (await store.stats())["bytes_stored"] == 0
        await store.close()

    run(go())
