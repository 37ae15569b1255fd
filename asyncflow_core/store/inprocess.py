"""The in-process store: a controller and one storage unit in the caller's process (the embedded default).

No server and no serialization: ``get`` reads straight from the storage
unit's buffers, handing out read-only views of its ragged arena where the
rows lie back to back (docs/store.md, "What get returns"). Every public method is safe to call from any thread and any
event loop: state changes happen under one lock in short synchronous
sections, and a blocked call waits on a future of its own loop that the
changing call resolves thread-safely. There is no polling: a waiter sleeps
until notified, its own timeout, or the earliest lease deadline (when an
expired lease may free rows for it), whichever comes first.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from pydantic import ConfigDict, Field

from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.store.options import StoreOptions
from asyncflow_core.store.controller import Controller, normalize_versions
from asyncflow_core.store.errors import (
    InvalidRequestError,
    LeaseError,
    StoreClosedError,
    StoreFullError,
    StoreTimeoutError,
)
from asyncflow_core.store.deployments.features import INPROCESS_FEATURES
from asyncflow_core.store.storage import StorageUnit
from asyncflow_core.types import Batch, Column, RaggedTensor

T = TypeVar("T")

FEATURES = INPROCESS_FEATURES


class InProcessStoreConfig(StoreOptions):
    """Options of the ``inprocess`` store (the shared controller options plus these)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    device: str = Field("cpu", description="Device the column values are kept on.")
    clock: Callable[[], float] | None = Field(
        None,
        exclude=True,
        description="Monotonic clock (seconds) for lease deadlines; default time.monotonic. Tests inject a fake one "
        "to expire leases without sleeping.",
    )


#: what a put blocked on capacity waits for (rows collected); see :class:`_Waiters`
_CAPACITY = "<capacity>"
_CAPACITY_EVENTS = frozenset((_CAPACITY,))


def _task_event(task: str | None) -> str:
    """What a get_meta of ``task`` waits for besides its columns: rows of the task freed (release, expiry) or done."""
    return f"<task {task}>"


class _Waiters:
    """Futures of blocked calls, each on its own loop and with what can unblock it; woken thread-safely.

    A waiter names what it waits for: events (its task's rows freed,
    capacity) and, for a lease, the columns a row needs. A change wakes only
    the waiters it can unblock — one of their events, or a write after which
    some written row has every column they need — so a store with many
    streaming stages does not retry every blocked lease on every write (each
    retry scans the rows). ``None`` (wait or wake) means everything. A lease
    whose sampler hands out whole groups only names a ``gate`` (its task and
    the group size): a write wakes it only when it may have completed a group
    (``Controller.may_complete_group``), not on every write to a group's rows.
    """

    def __init__(self) -> None:
        self._items: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, frozenset[str] | None,
                                frozenset[str], tuple[str, int] | None]] = []

    def add(self, events: frozenset[str] | None = None, columns: frozenset[str] = frozenset(),
            gate: tuple[str, int] | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._items.append((loop, fut, events, columns, gate))
        return fut

    def discard(self, fut: asyncio.Future) -> None:
        self._items = [item for item in self._items if item[1] is not fut]

    def wake(self, events: Collection[str] | None,
             written: tuple[Collection[str], Callable[[frozenset[str], tuple[str, int] | None], bool]] | None = None
             ) -> None:
        """Wake the waiters for any of ``events`` (every waiter when None) and, with ``written`` = (the columns
        a put wrote, whether a lease of a set of columns, behind a gate, can now succeed), the leases it
        satisfies."""
        if events is None:
            self.wake_all()
            return
        if not self._items:  # nobody waits (the common case on a busy store): nothing to check
            return
        answers: dict[tuple[frozenset[str], tuple[str, int] | None], bool] = {}

        def satisfied(columns: frozenset[str], gate: tuple[str, int] | None) -> bool:
            if written is None or columns.isdisjoint(written[0]):
                return False
            key = (columns, gate)
            if key not in answers:
                answers[key] = written[1](columns, gate)
            return answers[key]

        woken, kept = [], []
        for item in self._items:
            hit = item[2] is None or not item[2].isdisjoint(events) or satisfied(item[3], item[4])
            (woken if hit else kept).append(item)
        self._items = kept
        _resolve_all(woken, None)

    def wake_all(self, exc: BaseException | None = None) -> None:
        items, self._items = self._items, []
        _resolve_all(items, exc)


def _resolve_all(items: list, exc: BaseException | None) -> None:
    running = asyncio._get_running_loop()  # noqa: SLF001 - the cheap probe (no exception when there is none)
    for loop, fut, *_ in items:
        if loop is running:  # the waiter's loop runs this thread: same queue, without waking its selector
            loop.call_soon(_resolve, fut, exc)
            continue
        try:
            loop.call_soon_threadsafe(_resolve, fut, exc)
        except RuntimeError:  # that loop is closed: nobody is waiting there any more
            pass


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
            fut.exception()  # a waiter cancelled meanwhile never reads it: keep asyncio from logging it as lost


class InProcessStore(StreamStore):
    """The :class:`StreamStore` in the caller's process: a :class:`Controller` plus one :class:`StorageUnit`.

    Build it from a config (``InProcessStore(InProcessStoreConfig(capacity=...))``)
    or through the plugin manager as ``inprocess``. Besides the contract it
    offers :meth:`expire_leases` (expire overdue leases now, e.g. after a
    test advanced its fake clock) and exposes ``controller`` / ``storage``.
    """

    def __init__(self, config: InProcessStoreConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = InProcessStoreConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
        self.config = config
        self._clock = config.clock or time.monotonic
        self.controller = Controller(
            config.capacity,
            group_size=config.group_size,
            sampler_options=config.sampler_options,
            default_sampler=config.sampler,
            default_lease_s=config.lease_s,
            max_candidates=config.max_candidates,
        )
        self.storage = StorageUnit(config.device)
        self._lock = threading.Lock()
        self._waiters = _Waiters()
        self._closed = False
        self._token_columns = tuple(config.token_columns)
        self._task_events: dict[str | None, str] = {}  #: task -> its waiters' event (see _task_event), built once

    @property
    def features(self) -> StoreFeatures:
        return FEATURES

    # ------------------------------------------------------------------ machinery

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; create a new one (or load a checkpoint into a new one)")

    def _expire_locked(self) -> None:
        expired, _ = self.controller.expire(self._clock())
        if expired:
            self._waiters.wake_all()

    def _call(self, fn: Callable[[], T], wakes: Collection[str] | None = None,
              written: Collection[str] = ()) -> T:
        """Run a state change under the lock, then wake the waiters for ``wakes`` and for the rows ``fn``
        returned ``written`` (None, or when ``fn`` raised: every waiter, since a failed call may still have
        changed something, e.g. expired a lease)."""
        with self._lock:
            self._check_open()
            ok = False
            result = None
            try:
                self._expire_locked()
                result = fn()
                ok = True
                return result
            finally:
                if self._waiters._items:  # nobody waits (the usual case): nothing to wake, nothing to work out
                    self._waiters.wake(wakes if ok else None, self._written(result, written) if ok else None)

    def _written(self, meta: Any, columns: Collection[str]) -> tuple[Collection[str], Callable] | None:
        """What a put of ``columns`` to ``meta``'s rows can unblock (see :meth:`_Waiters.wake`); call under the lock."""
        if not columns or not isinstance(meta, BatchMeta):
            return None
        ids = meta.row_ids
        ctl = self.controller

        def can_lease(need: frozenset[str], gate: tuple[str, int] | None) -> bool:
            return ctl.any_ready(ids, need) if gate is None else ctl.may_complete_group(ids, need, *gate)

        return columns, can_lease

    def _event_of(self, task: str | None) -> str:
        """:func:`_task_event` of ``task``, formatted once per task."""
        event = self._task_events.get(task)
        if event is None:
            event = self._task_events[task] = _task_event(task)
        return event

    def _lease_task(self, meta: BatchMeta) -> str | None:
        return self.controller.lease_task(meta.lease_id) if isinstance(meta.lease_id, int) else None

    async def _block(self, attempt: Callable[[], T | None], timeout: float | None, what: Callable[[], str],
                     waits_for: frozenset[str] | None = None, columns: Collection[str] = frozenset(),
                     wakes: Collection[str] | None = None, written: Collection[str] = (),
                     gate: tuple[str, int] | Callable[[], tuple[str, int] | None] | None = None) -> T:
        """Retry ``attempt`` (under the lock) until it returns non-None, waking only when notified of one of
        ``waits_for`` (None: any change) or of rows with every one of ``columns`` ready, at the earliest lease
        deadline, or at ``timeout``; success wakes the waiters for ``wakes`` and for ``written`` columns.

        ``what`` (the call, for the timeout's message), ``gate`` when callable, and the frozenset of
        ``columns`` are worked out only when the call has to wait: most calls succeed at once."""
        if timeout is not None and timeout < 0:
            raise InvalidRequestError(f"timeout must be >= 0 or None, got {timeout}")
        loop = asyncio.get_running_loop()
        give_up = None if timeout is None else loop.time() + timeout
        while True:
            with self._lock:
                self._check_open()
                self._expire_locked()
                result = attempt()
                if result is not None:
                    if self._waiters._items:  # nobody waits (the usual case): nothing to wake
                        self._waiters.wake(wakes, self._written(result, written))
                    return result
                if give_up is not None and loop.time() >= give_up:
                    raise StoreTimeoutError(
                        f"{what()} did not complete within {timeout}s; raise the timeout, or check that a producer "
                        "is writing the columns asked for (and that consumers acknowledge rows)"
                    )
                if callable(gate):
                    gate = gate()
                if not isinstance(columns, frozenset):
                    columns = frozenset(columns)
                fut = self._waiters.add(waits_for, columns, gate)
                next_deadline = self.controller.next_deadline()
            delay = None if give_up is None else max(0.0, give_up - loop.time())
            if next_deadline is not None:
                until_expiry = max(0.0, next_deadline - self._clock())
                delay = until_expiry if delay is None else min(delay, until_expiry)
            try:
                # asyncio.wait, not wait_for: on Python 3.11 wait_for swallows a cancellation that races with
                # the future completing, which would leave a cancelled consumer blocked here
                await asyncio.wait((fut,), timeout=delay)
            finally:
                if not fut.done():
                    with self._lock:
                        self._waiters.discard(fut)
                    fut.cancel()

    def _num_tokens(self, ids: torch.Tensor, columns: Mapping[str, Column], new: bool = False) -> np.ndarray | None:
        """Per-row token count after a write of ``columns``: the summed lengths of the stored token columns (of
        new rows, which hold only what was just written, the written columns' own lengths)."""
        token_columns = self._token_columns
        if not any(c in columns for c in token_columns):
            return None
        total = None  # numpy: no torch call per column (store/indexing.py)
        for c in token_columns:
            if new:
                col = columns.get(c)
                if not isinstance(col, RaggedTensor):
                    continue
                offsets = col.offsets.numpy() if col.offsets.is_cpu else col.offsets.cpu().numpy()
                lengths = offsets[1:] - offsets[:-1]
            else:
                lengths = self.storage.lengths(ids, c).numpy()
            if total is None:
                total = lengths  # a fresh array (a difference, or what lengths() returned)
            else:
                total += lengths
        return np.zeros(ids.numel(), dtype=np.int64) if total is None else total

    # ------------------------------------------------------------------ the contract

    async def register_task(self, task: str, *, consumes: Sequence[str] = (), produces: Sequence[str] = (),
                            partition: str | None = None) -> None:
        self._call(lambda: self.controller.register_task(task, consumes, produces, partition))

    async def put(
        self,
        columns: Mapping[str, Column],
        *,
        rows: BatchMeta | None = None,
        partition: str = "default",
        group_ids: torch.Tensor | Sequence[int] | None = None,
        versions: torch.Tensor | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> BatchMeta:
        cols = dict(columns)
        names = tuple(cols)
        if rows is not None:
            if group_ids is not None:
                raise InvalidRequestError("group_ids apply to new rows only; put(rows=...) writes existing rows")
            ids = torch.as_tensor(rows.row_ids, dtype=torch.int64).reshape(-1)

            def write_existing() -> BatchMeta:
                self.controller.check_rows(ids)
                self.storage.validate(ids.numel(), cols)
                v = normalize_versions(versions, ids.numel())
                self.storage.write(ids, cols, validated=True)
                self.controller.mark_ready(ids, names, v, self._num_tokens(ids, cols))
                return BatchMeta(row_ids=ids.clone(), columns=names, extra={"partition": partition})

            return self._call(write_existing, wakes=(), written=names)
        if not cols:
            raise InvalidRequestError("put of new rows needs at least one column (the columns say how many rows)")
        first = next(iter(cols.values()))
        # not a tensor: 0 rows here, and storage.validate names the column and its type
        n = len(first) if isinstance(first, RaggedTensor) else (
            int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 0)

        def attempt() -> BatchMeta | None:
            self.storage.validate(n, cols)
            v = normalize_versions(versions, n)
            try:
                ids = self.controller.add_rows(n, partition, group_ids)
            except StoreFullError:
                if block:
                    return None
                raise
            self.storage.write(ids, cols, validated=True)
            # the rows add_rows just made, nothing else changed them: readiness written without reading it
            self.controller.mark_new_ready(ids, names, v, self._num_tokens(ids, cols, new=True))
            gids = None if group_ids is None else torch.as_tensor(group_ids, dtype=torch.int64).reshape(-1)
            return BatchMeta._trusted(row_ids=ids, columns=names, group_ids=gids, extra={"partition": partition})

        return await self._block(attempt, timeout, lambda: f"put of {n} rows (waiting for capacity)",
                                 waits_for=_CAPACITY_EVENTS, wakes=(), written=names)

    async def get_meta(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: str | None = None,
        min_version: int | None = None,
        partition: str | None = None,
        partial: bool = False,
        timeout: float | None = None,
        lease_s: float | None = None,
        consumer: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> BatchMeta:
        columns = tuple(columns)
        # no separate check first: try_lease checks the request (the same typed errors) before it changes
        # anything, under the lock, in the first attempt

        def attempt() -> BatchMeta | None:
            return self.controller.try_lease(
                task, columns, batch_size, sampler, min_version, partition, partial, lease_s, consumer,
                dp_rank, dp_size, self._clock(),
            )

        def gate() -> tuple[str, int] | None:  # asked only when the call waits (under the lock)
            group_size = self.controller.whole_group_size(sampler)
            return (task, group_size) if group_size else None

        # rows become leasable for the task when a column it needs is written or its rows are freed; a lease
        # wakes the task's other waiters (data-parallel ranks claim parts reserved for them)
        mine = self._event_of(task)
        return await self._block(
            attempt, timeout, lambda: f"get_meta({task!r}, {list(columns)}, batch_size={batch_size})",
            waits_for=frozenset((mine,)), columns=columns, wakes=(mine,), gate=gate)

    async def get(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> Batch:
        names = tuple(meta.columns if columns is None else columns)
        with self._lock:
            self._check_open()
            return self.storage.read(meta.row_ids, names, views=True)

    async def ack(self, meta: BatchMeta) -> None:
        if meta.lease_id is None:
            raise LeaseError("this meta holds no lease (put() returns rows, not leases); ack what get_meta() returned")

        wakes: list[str] = []

        def do() -> None:
            # collected rows free capacity; the task's own waiters may now see the end of the stream
            wakes.extend((_CAPACITY, self._event_of(self._lease_task(meta))))
            self.storage.free(self.controller.ack_and_collect(meta.lease_id, now=self._clock())[1])

        self._call(do, wakes=wakes)

    async def release(self, meta: BatchMeta) -> None:
        if meta.lease_id is None:
            raise LeaseError("this meta holds no lease (put() returns rows, not leases); release what get_meta() returned")
        wakes: list[str] = []

        def do() -> None:
            wakes.append(_task_event(self._lease_task(meta)))
            self.controller.release(meta.lease_id, now=self._clock())

        self._call(do, wakes=wakes)

    async def renew(self, meta: BatchMeta, *, lease_s: float | None = None) -> float | None:
        if meta.lease_id is None:
            raise LeaseError("this meta holds no lease (put() returns rows, not leases); renew what get_meta() "
                             "returned")
        wakes: list[str] = []

        def do() -> float | None:
            task = self._lease_task(meta)
            if self.controller.renew(meta.lease_id, lease_s, now=self._clock()):
                return self.controller.lease_info(meta.lease_id)["deadline"]
            if task is not None:  # it was live until this call found its deadline passed: its rows are free now
                wakes.append(_task_event(task))
            return None

        return self._call(do, wakes=wakes)

    async def declare_dead(self, consumer: str) -> int:
        return self._call(lambda: self.controller.declare_dead(consumer))

    async def end_stream(self, partition: str | None = None) -> None:
        self._call(lambda: self.controller.end_stream(partition))

    async def clear(self, partition: str | None = None) -> int:
        def do() -> int:
            dropped = self.controller.clear(partition)
            self.storage.free(dropped)
            return int(dropped.numel())

        return self._call(do)

    async def expire_leases(self) -> int:
        """Expire every lease whose deadline passed on the store's clock; returns how many. Wakes waiters."""
        with self._lock:
            self._check_open()
            expired, _ = self.controller.expire(self._clock())
            self._waiters.wake_all()
            return len(expired)

    async def state_dict(self) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            return {"format": 1, "controller": self.controller.state_dict(), "storage": self.storage.state_dict()}

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != 1 or "controller" not in state:
            raise InvalidRequestError("not an in-process store state_dict; pass what state_dict() returned")

        def do() -> None:
            ctl_backup, st_backup = self.controller.state_dict(), self.storage.state_dict()
            try:
                self.controller.load_state_dict(state["controller"])
                self.storage.load_state_dict(state["storage"])
            except Exception:
                self.controller.load_state_dict(ctl_backup)  # a rejected load leaves the store as it was
                self.storage.load_state_dict(st_backup)
                raise

        self._call(do)

    async def stats(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            self._expire_locked()
            out = self.controller.stats()
            out["bytes_stored"] = self.storage.nbytes
            return out

    async def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._waiters.wake_all(StoreClosedError("the store was closed while this call was waiting"))
