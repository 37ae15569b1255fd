"""What ``get`` returns in process: read-only views of the arena that keep their values while referenced.

The rule (docs/store.md, "What get returns"): a batch may share memory with
the store; the store never writes memory that a batch it handed out still
sees, so a held batch reads the same values after its rows were
acknowledged, collected, overwritten or compacted away. Once the batch is
dropped, the arena's memory is reused.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.store import StorageUnit
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.types import RaggedTensor


def rag(seqs):
    return RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in seqs], dtype=torch.int64)


async def _store() -> InProcessStore:
    store = InProcessStore(capacity=256)
    await store.register_task("rollout", produces=["ids", "reward"])
    await store.register_task("train", consumes=["ids"])
    return store


async def _loop(store: InProcessStore, seqs: list[list[int]]):
    """put, lease, get, ack: the batch read back (its rows collected by the ack)."""
    await store.put({"ids": rag(seqs), "reward": torch.zeros(len(seqs))})
    meta = await store.get_meta("train", ["ids"], len(seqs), timeout=1)
    batch = await store.get(meta, ["ids", "reward"])
    await store.ack(meta)
    return batch


def test_get_hands_out_views_of_rows_put_together():
    """Rows read as one put wrote them come back as a view (no copy); a dense column is the caller's own copy."""

    async def go():
        store = await _store()
        await store.put({"ids": rag([[1, 2, 3], [4], [5, 6]]), "reward": torch.tensor([1.0, 2.0, 3.0])})
        meta = await store.get_meta("train", ["ids"], 3, timeout=1)
        a, b = await store.get(meta, ["ids", "reward"]), await store.get(meta, ["ids", "reward"])
        assert a["ids"].to_list() == [[1, 2, 3], [4], [5, 6]]
        assert a["ids"].values.data_ptr() == b["ids"].values.data_ptr()  # both views of the same arena range
        assert a["reward"].data_ptr() != b["reward"].data_ptr()
        await store.close()

    asyncio.run(go())


def test_a_held_batch_keeps_its_values_after_its_rows_are_collected_and_the_arena_is_reused():
    async def go():
        store = await _store()
        held = await _loop(store, [[7] * 40, [8] * 40])
        want = held["ids"].values.clone()
        for i in range(30):  # ack collects, new puts would restart and compact the arena over the old range
            await _loop(store, [[i] * 40, [i + 1] * 40, [i + 2] * 3])
        assert torch.equal(held["ids"].values, want)
        assert held["ids"].to_list() == [[7] * 40, [8] * 40]
        await store.close()

    asyncio.run(go())


def test_a_dropped_batch_gives_the_arena_back():
    """With nothing held, each loop's put lands where the previous one did: the arena's pages are reused."""

    async def go():
        store = await _store()
        ptrs = []
        for i in range(4):
            batch = await _loop(store, [[i] * 50, [i] * 50])
            ptrs.append(batch["ids"].values.data_ptr())
            del batch
            gc.collect()
        assert len(set(ptrs[1:])) == 1, ptrs
        await store.close()

    asyncio.run(go())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "overwrite", "free", "free_all", "read", "drop"]),
                          st.integers(1, 6), st.integers(1, 1500)), min_size=1, max_size=40))
def test_views_never_change_while_held(steps):
    """Model check of the storage unit: whatever writes, overwrites and frees follow, every view still held reads
    the values it was read with."""
    unit = StorageUnit()
    live: dict[int, list[int]] = {}
    held: list[tuple[RaggedTensor, list[list[int]]]] = []
    next_id = 0
    for op, k, length in steps:
        if op == "put":
            ids = list(range(next_id, next_id + k))
            next_id += k
            seqs = [[next_id * 1000 + j] * (length + j) for j in range(k)]
            unit.write(torch.tensor(ids), {"v": rag(seqs)})
            live.update(zip(ids, seqs, strict=True))
        elif op == "overwrite" and live:
            ids = sorted(live)[:k]
            seqs = [[-next_id - j] * length for j in range(len(ids))]
            next_id += 1
            unit.write(torch.tensor(ids), {"v": rag(seqs)})
            live.update(zip(ids, seqs, strict=True))
        elif op in ("free", "free_all") and live:  # freeing everything restarts the arena, freeing much compacts it
            ids = sorted(live)[: k if op == "free" else None]
            unit.free(torch.tensor(ids))
            for r in ids:
                del live[r]
        elif op == "read" and live:
            ids = sorted(live)[:k]
            col = unit.read(torch.tensor(ids), ["v"], views=True)["v"]
            held.append((col, [live[r] for r in ids]))
        elif op == "drop" and held:
            held.pop(0)
        for col, want in held:
            assert col.to_list() == want


@pytest.mark.gpu
def test_views_on_a_cuda_storage_unit():
    """On a CUDA unit: dense columns come back as the caller's copies on the device, ragged rows put together as a
    view of the device arena, and a held view keeps its values while the arena restarts and compacts under it
    (the storage use count is torch's for CUDA storage too). Fixed by reading the code paths, never run here."""
    unit = StorageUnit("cuda")
    unit.write(torch.tensor([0, 1]), {"v": rag([[1] * 3000, [2] * 3000]), "r": torch.tensor([0.5, 1.5])})
    batch = unit.read(torch.tensor([0, 1]), ["v", "r"], views=True)
    assert batch["v"].values.is_cuda and batch["r"].is_cuda
    again = unit.read(torch.tensor([0, 1]), ["v", "r"], views=True)
    assert again["v"].values.data_ptr() == batch["v"].values.data_ptr()
    assert again["r"].data_ptr() != batch["r"].data_ptr()
    unit.free(torch.tensor([0, 1]))
    for i in range(2, 12):  # restarts and compactions that would rewrite the old range in place
        unit.write(torch.tensor([i]), {"v": rag([[i] * 5000]), "r": torch.tensor([float(i)])})
        unit.free(torch.tensor([i]))
    assert batch["v"].to("cpu").to_list() == [[1] * 3000, [2] * 3000]
    assert batch["r"].tolist() == [0.5, 1.5]
