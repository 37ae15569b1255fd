"""Conformance tests for StreamStore deployments, and a stateful model check any deployment can run.

A deployment's test module::

    from asyncflow_spec import StoreSpec
    from asyncflow_spec.store import make_store_state_machine

    class TestMyStore(StoreSpec):
        backend = "my-store"             # the name its plugin registered
        options = {"workers": 2}         # validated by the plugin's config model

    async def _create(*, capacity, lease_s, clock):
        return get_plugin_manager().create("store", "my-store", {"capacity": capacity, "lease_s": lease_s})

    TestMyStoreMachine = make_store_state_machine(_create, max_examples=10, fake_clock=False).TestCase

``StoreSpec`` passes ``capacity`` and ``lease_s`` options, and a fake
``clock`` (a zero-argument callable returning seconds) when
``fake_clock = True``: lease expiry is then tested by advancing that clock,
never by sleeping. A deployment whose clock cannot be injected (the
controller lives in another process) sets ``fake_clock = False`` and the
expiry tests skip.

Lease renewal (``renew``) is optional: a store that declares
``supports_lease_renewal=False`` gets its ``UnsupportedFeatureError``
checked instead, and builds its model check with
``make_store_state_machine(..., renewal=False)``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncflow_core.interfaces import BatchMeta, StoreFeatures, StreamStore
from asyncflow_core.plugins import PluginKind
from asyncflow_core.store.errors import (
    ColumnTypeError,
    InvalidRequestError,
    LeaseError,
    StoreClosedError,
    StoreFullError,
    StoreTimeoutError,
    UnknownColumnError,
    UnknownRowError,
)
from asyncflow_core.types import RaggedTensor
from asyncflow_spec.base import BackendSpec, expect_unsupported, forbid, require, run

STATS_KEYS = ("rows_live", "rows_leased", "rows_done", "rows_dropped", "bytes_stored")


class FakeClock:
    """A clock tests move by hand: ``clock()`` returns ``clock.now``; ``clock.advance(dt)`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def _ragged(seqs: list[list[int]]) -> RaggedTensor:
    return RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in seqs], dtype=torch.int64)


async def _setup_tasks(store: StreamStore) -> None:
    await store.register_task("rollout", produces=["prompt_ids", "response_ids"])
    await store.register_task("reward", consumes=["prompt_ids", "response_ids"], produces=["reward"])
    await store.register_task("train", consumes=["response_ids", "reward"])


class StoreSpec(BackendSpec):
    """Subclass and set ``backend``/``options``; set ``fake_clock = False`` if the store cannot take a ``clock``."""

    kind = PluginKind.STORE
    fake_clock: ClassVar[bool] = True

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def make_store(self, make_backend, clock) -> Callable[..., StreamStore]:
        """``make_store(capacity=..., lease_s=...)``: a new store with the suite's fake clock when supported."""

        def make(capacity: int = 64, lease_s: float = 30.0, **more: Any) -> StreamStore:
            extra = {"clock": clock} if self.fake_clock else {}
            return make_backend(capacity=capacity, lease_s=lease_s, **extra, **more)

        return make

    # ------------------------------------------------------------------ registration

    def test_registration_declares_store_features(self, registration, make_store):
        """The plugin registers a StoreBackend whose ``features`` equal the built store's; fix the record or the property."""
        assert isinstance(registration.record.features, StoreFeatures)
        store = make_store()
        assert store.features == registration.record.features
        run(store.close())

    # ------------------------------------------------------------------ data path

    def test_put_then_get_round_trips_dense_and_ragged(self, make_store):
        """Values come back unchanged, in the leased meta's order, with ``row_ids`` set. Fix put/get data movement."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            prompts = [[1, 2, 3], [4], [5, 6]]
            put = await store.put({"prompt_ids": _ragged(prompts), "response_ids": _ragged([[7], [8, 9], []])})
            assert put.row_ids.tolist() == sorted(put.row_ids.tolist()) and len(put) == 3
            meta = await store.get_meta("reward", ["prompt_ids", "response_ids"], 3, timeout=5)
            batch = await store.get(meta)
            assert batch.row_ids.tolist() == meta.row_ids.tolist()
            by_row = dict(zip(put.row_ids.tolist(), prompts, strict=True))
            assert batch["prompt_ids"].to_list() == [by_row[r] for r in meta.row_ids.tolist()]
            await store.put({"reward": torch.tensor([0.5, 1.0, -1.0])}, rows=meta)
            await store.ack(meta)
            m2 = await store.get_meta("train", ["reward"], 3, timeout=5)
            rewards = (await store.get(m2))["reward"]
            assert rewards.dtype == torch.float32
            expected = dict(zip(meta.row_ids.tolist(), [0.5, 1.0, -1.0], strict=True))
            assert rewards.tolist() == [expected[r] for r in m2.row_ids.tolist()]
            await store.close()

        run(go())

    def test_a_read_batch_keeps_its_values_while_referenced(self, make_store):
        """A batch from ``get`` may share memory with the store, but it keeps the values it was read with after its
        rows are acknowledged, collected and overwritten by later puts (the store never writes memory a batch still
        sees). Fix the store's reuse of memory a handed-out batch views (copy on write, pins)."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            await store.register_task("reader", consumes=["response_ids"])
            first = [[7] * 40, [8] * 40, [9] * 3]
            put = await store.put({"response_ids": _ragged(first)})
            meta = await store.get_meta("reader", ["response_ids"], 3, timeout=5)
            held = (await store.get(meta))["response_ids"]
            by_row = dict(zip(put.row_ids.tolist(), first, strict=True))
            want = [by_row[r] for r in meta.row_ids.tolist()]
            await store.clear()  # the rows are gone: their memory may be reused
            for i in range(20):
                put = await store.put({"response_ids": _ragged([[i] * 40, [i + 1] * 40, [i + 2] * 3])})
                m = await store.get_meta("reader", ["response_ids"], 3, timeout=5)
                await store.get(m)
                await store.clear()
            assert held.to_list() == want
            await store.close()

        run(go())

    def test_rows_are_leased_only_when_requested_columns_are_ready(self, make_store):
        """A row is handed out only once every requested column was written (the ready bits). Fix readiness tracking."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            put = await store.put({"prompt_ids": _ragged([[1], [2]])})
            with pytest.raises(StoreTimeoutError):
                await store.get_meta("reward", ["prompt_ids", "response_ids"], 1, timeout=0)
            await store.put({"response_ids": _ragged([[3]])}, rows=BatchMeta(row_ids=put.row_ids[1:]))
            meta = await store.get_meta("reward", ["prompt_ids", "response_ids"], 2, partial=True, timeout=5)
            assert meta.row_ids.tolist() == put.row_ids[1:].tolist()
            await store.close()

        run(go())

    # ------------------------------------------------------------------ leases

    def test_exactly_once_per_task(self, make_store):
        """Each task gets each row once; after ``ack`` it never gets it again, other tasks still do. Fix per-task states."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]] * 4), "response_ids": _ragged([[2]] * 4)})
            seen = []
            for _ in range(2):
                m = await store.get_meta("reward", ["response_ids"], 2, timeout=5)
                seen += m.row_ids.tolist()
                await store.ack(m)
            assert len(set(seen)) == 4
            with pytest.raises(StoreTimeoutError):
                await store.get_meta("reward", ["response_ids"], 1, timeout=0)
            await store.close()

        run(go())

    def test_release_and_consumer_death_return_rows(self, make_store):
        """``release`` and ``declare_dead`` put rows back to free for the task; nothing is lost. Fix lease bookkeeping."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            put = await store.put({"prompt_ids": _ragged([[1]] * 2), "response_ids": _ragged([[2]] * 2)})
            m = await store.get_meta("reward", ["response_ids"], 2, timeout=5, consumer="w0")
            await store.release(m)
            with pytest.raises(LeaseError):
                await store.release(m)
            m = await store.get_meta("reward", ["response_ids"], 2, timeout=5, consumer="w1")
            assert await store.declare_dead("w1") == 2
            with pytest.raises(LeaseError):
                await store.ack(m)
            m = await store.get_meta("reward", ["response_ids"], 2, timeout=5, consumer="w2")
            assert sorted(m.row_ids.tolist()) == put.row_ids.tolist()
            await store.close()

        run(go())

    def test_lease_expiry_returns_rows_and_rejects_late_ack(self, make_store, clock):
        """A lease not acknowledged by its deadline goes back to free; acking it later raises LeaseError.
        Uses the injected clock (no sleeping). Fix deadline handling, or accept a ``clock`` option."""
        if not self.fake_clock:
            pytest.skip("this store cannot take an injected clock (fake_clock = False)")

        async def go():
            store = make_store(lease_s=10.0)
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]]), "response_ids": _ragged([[2]])})
            m = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            assert m.deadline == pytest.approx(clock.now + 10.0)
            clock.advance(10.0)
            m2 = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            assert m2.row_ids.tolist() == m.row_ids.tolist() and m2.lease_id != m.lease_id
            with pytest.raises(LeaseError):
                await store.ack(m)
            await store.ack(m2)
            with pytest.raises(LeaseError):
                await store.ack(m2)
            await store.close()

        run(go())

    # ------------------------------------------------------------------ lease renewal (optional)

    def test_renew_keeps_a_lease_past_its_first_deadline(self, make_store, clock):
        """``renew(meta)`` pushes a live lease's deadline to now + lease_s and returns it; the rows stay leased
        past the first deadline and the ack still works. Fix ``renew`` (or declare supports_lease_renewal=False).
        With the injected clock the old deadline is passed for real; without it only the answers are checked."""

        async def go():
            store = make_store(lease_s=10.0)
            require(store.features, "supports_lease_renewal")
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]]), "response_ids": _ragged([[2]])})
            m = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            if self.fake_clock:
                clock.advance(6.0)
                assert await store.renew(m) == pytest.approx(clock.now + 10.0)
                clock.advance(6.0)  # past the lease's first deadline, inside the renewed one
                assert await store.renew(m, lease_s=30.0) == pytest.approx(clock.now + 30.0)
                clock.advance(29.0)
            else:
                first = await store.renew(m)
                assert isinstance(first, float) and first >= m.deadline
                assert await store.renew(m, lease_s=30.0) >= first + 19.0
            with pytest.raises(StoreTimeoutError):  # still held: not handed out again
                await store.get_meta("reward", ["response_ids"], 1, timeout=0)
            with pytest.raises(InvalidRequestError):
                await store.renew(m, lease_s=0.0)
            await store.ack(m)
            assert (await store.stats())["rows_leased"] == 0
            await store.close()

        run(go())

    def test_renew_answers_none_once_the_lease_is_not_held(self, make_store, clock):
        """A lease acknowledged, released, freed by ``declare_dead`` or (injected clock) expired renews to ``None``,
        not an error, and stays finished; a meta that is not a lease raises LeaseError. Fix ``renew``."""

        async def go():
            store = make_store(lease_s=10.0)
            require(store.features, "supports_lease_renewal")
            await _setup_tasks(store)
            put = await store.put({"prompt_ids": _ragged([[1]] * 4), "response_ids": _ragged([[2]] * 4)})
            with pytest.raises(LeaseError):
                await store.renew(put)
            acked = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            await store.ack(acked)
            released = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            await store.release(released)
            dead = await store.get_meta("reward", ["response_ids"], 1, timeout=5, consumer="w0")
            await store.declare_dead("w0")
            for m in (acked, released, dead):
                assert await store.renew(m) is None
            with pytest.raises(LeaseError):
                await store.ack(dead)
            if self.fake_clock:
                late = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
                clock.advance(10.0)
                assert await store.renew(late) is None
                again = await store.get_meta("reward", ["response_ids"], 3, timeout=5)  # its row is free again
                assert set(late.row_ids.tolist()) <= set(again.row_ids.tolist())
            await store.close()

        run(go())

    def test_renew_unsupported_raises_the_documented_error(self, make_store):
        """With supports_lease_renewal off, ``renew`` raises UnsupportedFeatureError (the StreamStore default)."""

        async def go():
            store = make_store()
            forbid(store.features, "supports_lease_renewal")
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]]), "response_ids": _ragged([[2]])})
            m = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            await expect_unsupported(store.renew(m), "renew")
            await store.close()

        run(go())

    # ------------------------------------------------------------------ filters, capacity, streaming

    def test_version_filter_is_never_violated(self, make_store):
        """``get_meta(min_version=v)`` never returns a row whose min_version < v. Fix the version filter."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            versions = torch.tensor([[0, 1], [2, 2], [3, 4], [1, 5]])
            await store.put({"prompt_ids": _ragged([[1]] * 4), "response_ids": _ragged([[2]] * 4)}, versions=versions)
            m = await store.get_meta("reward", ["response_ids"], 4, min_version=2, partial=True, timeout=5)
            assert len(m) == 2 and bool((m.min_version >= 2).all())
            await store.close()

        run(go())

    def test_capacity_backpressure(self, make_store):
        """Beyond ``capacity`` live rows, ``put(block=False)`` raises StoreFullError and ``put(block=True)`` waits
        until acknowledged rows are collected. Fix capacity accounting or garbage collection after ack."""

        async def go():
            store = make_store(capacity=2)
            await _setup_tasks(store)
            full = {"prompt_ids": _ragged([[1]] * 2), "response_ids": _ragged([[2]] * 2)}
            await store.put(full)
            one = {"prompt_ids": _ragged([[1]]), "response_ids": _ragged([[2]])}
            with pytest.raises(StoreFullError):
                await store.put(one, block=False)
            with pytest.raises(StoreTimeoutError):
                await store.put(one, timeout=0)
            waiting = asyncio.ensure_future(store.put(one, timeout=30))
            m = await store.get_meta("reward", ["response_ids"], 1, timeout=5)
            await store.ack(m)
            await store.put({"reward": torch.tensor([1.0])}, rows=m)
            m2 = await store.get_meta("train", ["reward"], 1, timeout=5)
            assert not waiting.done()
            await store.ack(m2)  # done for every consumer: collected, space frees
            assert len(await waiting) == 1
            assert (await store.stats())["rows_live"] == 2
            await store.close()

        run(go())

    def test_consumer_wakes_when_rows_arrive(self, make_store):
        """A blocked ``get_meta`` returns as soon as a producer writes enough rows, without polling.
        Fix the notification from put to waiters."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            waiting = asyncio.ensure_future(store.get_meta("reward", ["prompt_ids", "response_ids"], 2, timeout=30))
            await asyncio.sleep(0)  # let it block (a scheduling point, not a wait for time)
            await store.put({"prompt_ids": _ragged([[1]]), "response_ids": _ragged([[2]])})
            await asyncio.sleep(0)
            assert not waiting.done()  # one row is not a batch of two
            await store.put({"prompt_ids": _ragged([[3]]), "response_ids": _ragged([[4]])})
            assert len(await waiting) == 2
            await store.close()

        run(go())

    def test_end_of_stream_after_drain(self, make_store):
        """After ``end_stream`` consumers get the remaining rows (a short final batch), then an empty meta with
        ``end_of_stream=True``; blocked consumers are woken. Fix end-of-stream detection."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]] * 3), "response_ids": _ragged([[2]] * 3)})
            m = await store.get_meta("reward", ["response_ids"], 2, timeout=5)
            await store.ack(m)
            waiting = asyncio.ensure_future(store.get_meta("reward", ["response_ids"], 2, timeout=30))
            await asyncio.sleep(0)
            await store.end_stream()
            last = await waiting
            assert len(last) == 1 and not last.end_of_stream
            await store.ack(last)
            eos = await store.get_meta("reward", ["response_ids"], 2, timeout=5)
            assert eos.end_of_stream and len(eos) == 0
            with pytest.raises(InvalidRequestError):
                await store.put({"prompt_ids": _ragged([[1]])})
            await store.close()

        run(go())

    def test_close_wakes_waiters(self, make_store):
        """``close`` wakes every blocked call with StoreClosedError; later calls raise it too; closing twice is fine."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            waiting = asyncio.ensure_future(store.get_meta("reward", ["response_ids"], 1, timeout=30))
            await asyncio.sleep(0)
            await store.close()
            with pytest.raises(StoreClosedError):
                await waiting
            with pytest.raises(StoreClosedError):
                await store.stats()
            await store.close()

        run(go())

    def test_clear_partition(self, make_store):
        """``clear(partition)`` drops that partition's rows only and returns how many. Fix partition bookkeeping."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]] * 2)}, partition="step0")
            await store.put({"prompt_ids": _ragged([[1]] * 3)}, partition="step1")
            assert await store.clear("step0") == 2
            assert (await store.stats())["rows_live"] == 3
            m = await store.get_meta("reward", ["prompt_ids"], 3, partition="step1", timeout=5)
            assert len(m) == 3
            await store.close()

        run(go())

    def test_partition_scoped_tasks(self, make_store):
        """A task registered with ``partition=P`` leases only P's rows (with ``partition=None`` too), ends with P's
        stream, and P's rows are collected once P's own consumers acknowledged them, independently of other
        partitions. Fix the task scope in leasing, end of stream or gc."""

        async def go():
            store = make_store()
            await store.register_task("rollout", produces=["prompt_ids", "response_ids"])
            await store.register_task("train", consumes=["response_ids"], partition="train")
            await store.register_task("eval", consumes=["response_ids"], partition="eval")
            cols = {"prompt_ids": _ragged([[1]] * 3), "response_ids": _ragged([[2]] * 3)}
            train_rows = await store.put(cols, partition="train")
            eval_rows = await store.put({k: v.select(torch.arange(2)) for k, v in cols.items()}, partition="eval")
            with pytest.raises(InvalidRequestError):
                await store.get_meta("train", ["response_ids"], 1, partition="eval", timeout=5)
            ev = await store.get_meta("eval", ["response_ids"], 8, partial=True, timeout=5)
            assert sorted(ev.row_ids.tolist()) == sorted(eval_rows.row_ids.tolist())
            await store.end_stream("train")
            tr = await store.get_meta("train", ["response_ids"], 8, timeout=5)  # the rest of train's stream
            assert sorted(tr.row_ids.tolist()) == sorted(train_rows.row_ids.tolist())
            await store.ack(ev)  # eval's rows go with eval's ack, while train still holds its lease
            assert (await store.stats())["rows_live"] == 3
            await store.ack(tr)
            assert (await store.stats())["rows_live"] == 0
            assert (await store.get_meta("train", ["response_ids"], 1, timeout=5)).end_of_stream
            await store.put({k: v.select(torch.arange(1)) for k, v in cols.items()}, partition="eval")
            more = await store.get_meta("eval", ["response_ids"], 1, timeout=5)  # eval's stream goes on
            assert len(more) == 1 and not more.end_of_stream
            await store.close()

        run(go())

    def test_stats_keys(self, make_store):
        """``stats`` reports at least rows_live, rows_leased, rows_done, rows_dropped and bytes_stored as ints."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1, 2]])})
            stats = await store.stats()
            for key in STATS_KEYS:
                assert isinstance(stats.get(key), int), f"stats() lacks int {key!r}: {stats}"
            assert stats["rows_live"] == 1 and stats["bytes_stored"] > 0
            await store.close()

        run(go())

    def test_dp_ranks_get_disjoint_parts_of_one_pick(self, make_store):
        """With ``dp_size`` ranks asking for one global batch, each gets a disjoint part and together they cover it."""

        async def go():
            store = make_store()
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1] * k for k in range(1, 9)]),
                             "response_ids": _ragged([[2]] * 8)})
            got = []
            for rank in (1, 0, 3, 2):
                m = await store.get_meta("reward", ["response_ids"], 8, sampler="token_balanced", dp_rank=rank,
                                         dp_size=4, timeout=5, consumer=f"rank{rank}")
                got.append(set(m.row_ids.tolist()))
            assert sum(len(g) for g in got) == 8 and len(set().union(*got)) == 8
            await store.close()

        run(go())

    # ------------------------------------------------------------------ bad input

    def test_bad_input_raises_typed_errors_and_changes_nothing(self, make_store):
        """Wrong dtype or row count, unknown rows, batch size 0 or above capacity, unknown columns and acks of
        unknown leases raise their typed StoreError subclass and leave the store unchanged."""

        async def go():
            store = make_store(capacity=8)
            await _setup_tasks(store)
            await store.put({"prompt_ids": _ragged([[1]]), "response_ids": _ragged([[2]])})
            before = await store.stats()
            float_prompts = RaggedTensor.from_sequences([[1.0]], dtype=torch.float32)
            with pytest.raises(ColumnTypeError):
                await store.put({"prompt_ids": float_prompts})
            with pytest.raises(ColumnTypeError):
                await store.put({"prompt_ids": _ragged([[1], [2]]), "response_ids": _ragged([[2]])})
            with pytest.raises(ColumnTypeError):
                await store.put({"prompt_ids": torch.tensor([1, 2])})  # dense where ragged was written
            with pytest.raises(UnknownRowError):
                await store.put({"reward": torch.tensor([1.0])}, rows=BatchMeta(row_ids=torch.tensor([10**9])))
            with pytest.raises(InvalidRequestError):
                await store.get_meta("reward", ["response_ids"], 0, timeout=0)
            with pytest.raises(InvalidRequestError):
                await store.get_meta("reward", ["response_ids"], 9, timeout=0)
            with pytest.raises(UnknownColumnError):
                await store.get_meta("reward", ["no_such_column"], 1, timeout=0)
            with pytest.raises(LeaseError):
                await store.ack(BatchMeta(row_ids=torch.tensor([0]), task="reward", lease_id=10**9))
            after = await store.stats()
            assert {k: after[k] for k in STATS_KEYS} == {k: before[k] for k in STATS_KEYS}
            m = await store.get_meta("reward", ["prompt_ids", "response_ids"], 1, timeout=5)
            assert (await store.get(m))["prompt_ids"].to_list() == [[1]]
            await store.close()

        run(go())

    # ------------------------------------------------------------------ checkpoint

    def test_checkpoint_round_trip_neither_repeats_nor_skips(self, make_store, registration):
        """After ``load_state_dict`` into a new store, done rows stay done, leased rows come back free, data and
        row ids survive. Fix state_dict/load_state_dict (or declare supports_checkpoint=False)."""
        if not registration.record.features.supports_checkpoint:
            pytest.skip("supports_checkpoint is False")

        async def go():
            store = make_store()
            await _setup_tasks(store)
            put = await store.put({"prompt_ids": _ragged([[i] for i in range(4)]), "response_ids": _ragged([[9]] * 4)})
            done = await store.get_meta("reward", ["prompt_ids", "response_ids"], 2, timeout=5)
            await store.ack(done)
            await store.get_meta("reward", ["prompt_ids", "response_ids"], 1, timeout=5)  # leased, never acked
            state = await store.state_dict()
            await store.close()
            restored = make_store()
            await restored.load_state_dict(state)
            rest = await restored.get_meta("reward", ["prompt_ids", "response_ids"], 4, partial=True, timeout=5)
            assert sorted(rest.row_ids.tolist()) == sorted(set(put.row_ids.tolist()) - set(done.row_ids.tolist()))
            data = (await restored.get(rest))["prompt_ids"].to_list()
            first = put.row_ids.tolist()[0]
            assert data == [[r - first] for r in rest.row_ids.tolist()]
            new = await restored.put({"prompt_ids": _ragged([[7]])})
            assert int(new.row_ids[0]) > max(put.row_ids.tolist())
            await restored.close()

        run(go())


# ====================================================================== the stateful model check

StoreFactory = Callable[..., "StreamStore | Awaitable[StreamStore]"]
TASK_COLUMNS = {"reward": ("prompt_ids", "response_ids"), "train": ("response_ids", "reward")}


def make_store_state_machine(
    create_store: StoreFactory,
    *,
    max_examples: int = 40,
    stateful_step_count: int = 30,
    fake_clock: bool = True,
    checkpoint: bool = True,
    capacity: int = 8,
    lease_s: float = 10.0,
    renewal: bool = True,
) -> type[RuleBasedStateMachine]:
    """A hypothesis state machine driving a store and a plain-Python model side by side.

    ``create_store(capacity=..., lease_s=..., clock=...)`` returns a new,
    empty store (or an awaitable of one); ``clock`` is a callable the store
    must use for lease deadlines, or ``None`` when ``fake_clock=False`` (then
    expiry steps are skipped). Use ``make_store_state_machine(...).TestCase``
    as a test class. ``renewal=False`` leaves out the ``renew`` steps (for a
    store that declares ``supports_lease_renewal=False``). After every step it checks: no row is handed to a task
    while leased or done for it, no ready row is lost (a full drain returns
    exactly the model's eligible rows), version filters hold, data reads back
    as written, capacity is respected.
    """

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.clock = FakeClock() if fake_clock else None
            self.store = self._new_store()
            self.run(_setup_tasks(self.store))
            self.rows: dict[int, dict[str, Any]] = {}  # row id -> partition, minv, data
            self.state: dict[tuple[str, int], str] = {}  # (task, row) -> "leased" | "done"
            self.leases: dict[int, dict[str, Any]] = {}
            self.finished: list[BatchMeta] = []
            self.prompt_written = False

        # -- plumbing
        def run(self, coro):
            return self.loop.run_until_complete(asyncio.wait_for(coro, 60))

        def _new_store(self) -> StreamStore:
            store = create_store(capacity=capacity, lease_s=lease_s, clock=self.clock)
            return self.run(store) if inspect.isawaitable(store) else store

        def teardown(self) -> None:
            try:
                self.run(self.store.close())
            finally:
                self.loop.close()

        def eligible(self, task: str, min_version: int | None, partition: str | None) -> set[int]:
            out = set()
            for r, row in self.rows.items():
                if (task, r) in self.state or any(c not in row["data"] for c in TASK_COLUMNS[task]):
                    continue
                if min_version is not None and (row["minv"] is None or row["minv"] < min_version):
                    continue
                if partition is not None and row["partition"] != partition:
                    continue
                out.add(r)
            return out

        def finish(self, lid: int, new: str | None) -> None:
            lease = self.leases.pop(lid)
            self.finished.append(lease["meta"])
            for r in lease["rows"]:
                if r in self.rows and self.state.get((lease["task"], r)) == "leased":
                    if new is None:
                        del self.state[(lease["task"], r)]
                    else:
                        self.state[(lease["task"], r)] = new

        def collect(self) -> None:
            for r in [r for r in self.rows if all(self.state.get((t, r)) == "done" for t in TASK_COLUMNS)]:
                self.drop(r)

        def drop(self, r: int) -> None:
            del self.rows[r]
            for t in TASK_COLUMNS:
                self.state.pop((t, r), None)

        # -- rules
        @rule(
            prompts=st.lists(st.lists(st.integers(0, 50), max_size=3), min_size=1, max_size=3),
            with_response=st.booleans(),
            version=st.integers(0, 3),
            partition=st.sampled_from(["a", "b"]),
        )
        def put_rows(self, prompts, with_response, version, partition):
            n = len(prompts)
            cols = {"prompt_ids": _ragged(prompts)}
            responses = [[version, i] for i in range(n)]
            if with_response:
                cols["response_ids"] = _ragged(responses)
            versions = torch.tensor([[version, version]] * n) if with_response else None
            if len(self.rows) + n > capacity:
                with pytest.raises(StoreFullError):
                    self.run(self.store.put(cols, partition=partition, versions=versions, block=False))
                return
            meta = self.run(self.store.put(cols, partition=partition, versions=versions, block=False))
            assert len(meta) == n and not set(meta.row_ids.tolist()) & set(self.rows)
            for i, r in enumerate(meta.row_ids.tolist()):
                data = {"prompt_ids": prompts[i]}
                if with_response:
                    data["response_ids"] = responses[i]
                self.rows[r] = {"partition": partition, "minv": version if with_response else None, "data": data}
            self.prompt_written = True

        @precondition(lambda self: self.rows)
        @rule(data=st.data(), version=st.integers(0, 3), reward=st.floats(-1, 1, width=32))
        def write_column(self, data, version, reward):
            r = data.draw(st.sampled_from(sorted(self.rows)))
            row = self.rows[r]
            meta = BatchMeta(row_ids=torch.tensor([r]))
            if "response_ids" not in row["data"]:
                self.run(self.store.put({"response_ids": _ragged([[version]])}, rows=meta,
                                        versions=torch.tensor([[version, version]])))
                row["data"]["response_ids"] = [version]
                row["minv"] = version if row["minv"] is None else min(row["minv"], version)
            else:
                self.run(self.store.put({"reward": torch.tensor([reward], dtype=torch.float32)}, rows=meta))
                row["data"]["reward"] = float(reward)

        @rule(
            task=st.sampled_from(sorted(TASK_COLUMNS)),
            batch_size=st.integers(1, 4),
            min_version=st.none() | st.integers(0, 3),
            partition=st.none() | st.sampled_from(["a", "b"]),
            consumer=st.sampled_from(["c1", "c2"]),
        )
        def lease(self, task, batch_size, min_version, partition, consumer):
            expected = self.eligible(task, min_version, partition)
            call = self.store.get_meta(task, TASK_COLUMNS[task], batch_size, min_version=min_version,
                                       partition=partition, partial=True, timeout=0, consumer=consumer)
            if not expected:
                with pytest.raises(StoreTimeoutError):
                    self.run(call)
                return
            meta = self.run(call)
            got = meta.row_ids.tolist()
            assert len(got) == len(set(got)) == min(batch_size, len(expected)), (got, expected)
            assert set(got) <= expected, f"handed out rows {set(got) - expected} not eligible for {task}"
            if min_version is not None:
                assert bool((meta.min_version >= min_version).all())
            for r in got:
                self.state[(task, r)] = "leased"
            deadline = self.clock.now + lease_s if self.clock else None
            self.leases[meta.lease_id] = {"task": task, "rows": got, "meta": meta, "deadline": deadline,
                                          "consumer": consumer, "lease_s": lease_s}

        @precondition(lambda self: self.leases)
        @rule(data=st.data())
        def read(self, data):
            lid = data.draw(st.sampled_from(sorted(self.leases)))
            lease = self.leases[lid]
            live = [r for r in lease["rows"] if r in self.rows]
            if len(live) != len(lease["rows"]):
                return  # some rows were cleared; reading them is an UnknownRowError, covered elsewhere
            batch = self.run(self.store.get(lease["meta"]))
            assert batch.row_ids.tolist() == lease["rows"]
            for c in TASK_COLUMNS[lease["task"]]:
                col = batch[c]
                values = col.to_list() if isinstance(col, RaggedTensor) else col.tolist()
                for r, v in zip(lease["rows"], values, strict=True):
                    want = self.rows[r]["data"][c]
                    assert v == pytest.approx(want), f"row {r} column {c}: read {v}, wrote {want}"

        @precondition(lambda self: self.leases)
        @rule(data=st.data())
        def ack(self, data):
            lid = data.draw(st.sampled_from(sorted(self.leases)))
            self.run(self.store.ack(self.leases[lid]["meta"]))
            self.finish(lid, "done")
            self.collect()

        @precondition(lambda self: self.leases)
        @rule(data=st.data())
        def release(self, data):
            lid = data.draw(st.sampled_from(sorted(self.leases)))
            self.run(self.store.release(self.leases[lid]["meta"]))
            self.finish(lid, None)

        @precondition(lambda self: self.finished)
        @rule(data=st.data())
        def ack_finished_lease_fails(self, data):
            meta = data.draw(st.sampled_from(self.finished))
            with pytest.raises(LeaseError):
                self.run(self.store.ack(meta))

        @precondition(lambda self: renewal and self.leases)
        @rule(data=st.data(), new_s=st.none() | st.sampled_from([lease_s / 2, 2 * lease_s]))
        def renew(self, data, new_s):
            lid = data.draw(st.sampled_from(sorted(self.leases)))
            lease = self.leases[lid]
            deadline = self.run(self.store.renew(lease["meta"], lease_s=new_s))
            assert deadline is not None, f"lease {lid} is live in the model but renew answered None"
            if new_s is not None:
                lease["lease_s"] = new_s
            if self.clock is not None:
                lease["deadline"] = self.clock.now + lease["lease_s"]
                assert deadline == pytest.approx(lease["deadline"])

        @precondition(lambda self: renewal and self.finished)
        @rule(data=st.data())
        def renew_finished_lease_answers_none(self, data):
            meta = data.draw(st.sampled_from(self.finished))
            assert self.run(self.store.renew(meta)) is None

        @precondition(lambda self: fake_clock)
        @rule(dt=st.sampled_from([1.0, 5.0, lease_s]))
        def advance_clock(self, dt):
            self.clock.advance(dt)
            for lid in [lid for lid, lease in self.leases.items() if lease["deadline"] <= self.clock.now]:
                self.finish(lid, None)

        @rule(consumer=st.sampled_from(["c1", "c2"]))
        def consumer_dies(self, consumer):
            mine = [lid for lid, lease in self.leases.items() if lease["consumer"] == consumer]
            expected = sum(
                sum(1 for r in self.leases[lid]["rows"] if r in self.rows) for lid in mine
            )
            assert self.run(self.store.declare_dead(consumer)) == expected
            for lid in mine:
                self.finish(lid, None)

        @rule(partition=st.none() | st.sampled_from(["a", "b"]))
        def clear(self, partition):
            gone = [r for r, row in self.rows.items() if partition is None or row["partition"] == partition]
            assert self.run(self.store.clear(partition)) == len(gone)
            for r in gone:
                self.drop(r)
            for lid in [lid for lid, lease in self.leases.items() if not set(lease["rows"]) & set(self.rows)]:
                self.finish(lid, None)

        @precondition(lambda self: checkpoint)
        @rule()
        def checkpoint_and_restore(self):
            state = self.run(self.store.state_dict())
            self.run(self.store.close())
            self.store = self._new_store()
            self.run(self.store.load_state_dict(state))
            for lid in list(self.leases):
                self.finish(lid, None)

        @precondition(lambda self: self.prompt_written)
        @rule()
        def bad_put_is_rejected(self):
            with pytest.raises(ColumnTypeError):
                self.run(self.store.put({"prompt_ids": RaggedTensor.from_sequences([[1.5]], dtype=torch.float32)},
                                        block=False))
            with pytest.raises(ColumnTypeError):
                self.run(self.store.put({"prompt_ids": _ragged([[1], [2]]), "response_ids": _ragged([[1]])},
                                        block=False))

        @rule(task=st.sampled_from(sorted(TASK_COLUMNS)))
        def drain_returns_exactly_the_eligible_rows(self, task):
            expected = self.eligible(task, None, None)
            call = self.store.get_meta(task, TASK_COLUMNS[task], capacity, partial=True, timeout=0)
            if not expected:
                with pytest.raises(StoreTimeoutError):
                    self.run(call)
                return
            meta = self.run(call)
            assert set(meta.row_ids.tolist()) == expected, "a ready, free row was lost (or an ineligible one leaked)"
            self.run(self.store.release(meta))

        # -- invariants
        @invariant()
        def counts_match_model(self):
            stats = self.run(self.store.stats())
            assert stats["rows_live"] == len(self.rows) <= capacity
            leased = sum(1 for (t, r), s in self.state.items() if s == "leased" and r in self.rows)
            assert stats["rows_leased"] == leased

    StoreMachine.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=stateful_step_count,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    return StoreMachine


__all__ = ["FakeClock", "StoreSpec", "make_store_state_machine"]
