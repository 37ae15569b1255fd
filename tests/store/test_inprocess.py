"""In-process store specifics: streaming overlap, backpressure, expiry wake-ups, the sync facade, config."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from pydantic import ValidationError

from asyncflow_core.store.errors import StoreClosedError
from asyncflow_core.store.inprocess import InProcessStore, InProcessStoreConfig
from asyncflow_core.store.sync import SyncStore
from asyncflow_core.types import RaggedTensor
from asyncflow_spec.store import FakeClock


def rag(seqs):
    return RaggedTensor.from_sequences(seqs, dtype=torch.int64)


async def setup(store):
    await store.register_task("rollout", produces=["prompt_ids", "response_ids"])
    await store.register_task("reward", consumes=["response_ids"], produces=["reward"])


def test_consumer_streams_while_producer_writes():
    """The consumer gets batches of 2 as rows arrive one by one; it never waits for the whole stream."""

    async def go():
        store = InProcessStore(capacity=64)
        await setup(store)
        got: list[list[int]] = []
        produced = 0

        async def consumer():
            while not (m := await store.get_meta("reward", ["response_ids"], 2, timeout=10)).end_of_stream:
                got.append((m.row_ids.tolist(), produced))
                await store.ack(m)

        task = asyncio.ensure_future(consumer())
        for i in range(6):
            await store.put({"prompt_ids": rag([[i]]), "response_ids": rag([[i, i]])})
            produced += 1
            await asyncio.sleep(0)  # yield to the consumer (a scheduling point, not a timed wait)
        await store.end_stream()
        await task
        assert [rows for rows, _ in got] == [[0, 1], [2, 3], [4, 5]]
        assert got[0][1] < 6  # the first batch was consumed before the producer finished
        await store.close()

    asyncio.run(go())


def test_put_blocks_until_space_then_proceeds():
    async def go():
        store = InProcessStore(capacity=2)
        await setup(store)
        await store.put({"response_ids": rag([[1], [2]])})
        blocked = asyncio.ensure_future(store.put({"response_ids": rag([[3]])}, timeout=10))
        await asyncio.sleep(0)
        assert not blocked.done()
        m = await store.get_meta("reward", ["response_ids"], 1, timeout=1)
        await store.ack(m)  # the only consumer task is done with the row: collected
        assert (await blocked).row_ids.tolist() == [2]
        await store.close()

    asyncio.run(go())


def test_expired_lease_wakes_a_blocked_consumer():
    """A consumer blocked on rows held by a lease is woken when that lease expires (fake clock, no sleep)."""

    async def go():
        clock = FakeClock()
        store = InProcessStore(capacity=8, lease_s=5, clock=clock)
        await setup(store)
        await store.put({"response_ids": rag([[1]])})
        held = await store.get_meta("reward", ["response_ids"], 1, timeout=1, consumer="crashed")
        waiting = asyncio.ensure_future(store.get_meta("reward", ["response_ids"], 1, timeout=10))
        await asyncio.sleep(0)
        clock.advance(5)
        assert await store.expire_leases() == 1
        assert (await waiting).row_ids.tolist() == held.row_ids.tolist()
        await store.close()

    asyncio.run(go())


def test_sync_facade_shares_the_store_with_async_code():
    """A worker thread uses SyncStore on the same store an async consumer waits on."""

    async def go():
        store = InProcessStore(capacity=8)
        await setup(store)
        sync = SyncStore(store)
        waiting = asyncio.ensure_future(store.get_meta("reward", ["response_ids"], 2, timeout=10))
        worker = threading.Thread(target=lambda: sync.put({"response_ids": rag([[1], [2]])}))
        worker.start()
        m = await waiting
        worker.join()
        batch = await asyncio.to_thread(sync.get, m)
        assert batch["response_ids"].to_list() == [[1], [2]]
        assert (await asyncio.to_thread(sync.stats))["rows_leased"] == 2
        await asyncio.to_thread(sync.close)
        with pytest.raises(StoreClosedError):
            await store.stats()

    asyncio.run(go())


def test_token_counts_feed_samplers():
    async def go():
        store = InProcessStore(capacity=8)
        await setup(store)
        await store.put({"prompt_ids": rag([[1, 2], [3]]), "response_ids": rag([[1, 1, 1], [2]])})
        m = await store.get_meta("reward", ["response_ids"], 2, timeout=1)
        assert m.num_tokens.tolist() == [5, 2]
        await store.close()

    asyncio.run(go())


def test_config_forbids_unknown_options_and_documents_fields():
    with pytest.raises(ValidationError):
        InProcessStoreConfig(capcity=3)
    assert all(f.description for f in InProcessStoreConfig.model_fields.values())
