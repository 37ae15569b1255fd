"""The asyncio control core every out-of-process deployment serves: a Controller plus notification waits.

:class:`~asyncflow_core.store.controller.Controller` is synchronous and takes
``now`` as an argument; this wrapper owns the clock, turns "not yet" answers
into waits, and wakes waiters on every state change (a put, ack, release,
dead consumer, expiry, end of stream, clear, close). Waiters also wake at the
next lease deadline, so expired leases come back without anyone polling.

The core does not hold column data: ``on_drop(row_ids)`` tells the data
plane which rows were collected (after an ack) or cleared, so it can free
their bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store.controller import Controller
from asyncflow_core.store.errors import (
    InvalidRequestError,
    LeaseError,
    StoreClosedError,
    StoreFullError,
    StoreTimeoutError,
)

T = TypeVar("T")


class StoreCore:
    """Controller + waits, single event loop. Methods mirror the StreamStore control calls.

    Public beyond the control calls: :meth:`notify`, :meth:`check_open` and
    :meth:`wait_until` (the one retry-until-notified loop that the core's own
    blocking calls and every deployment's data plane, e.g. arena grants, use).
    """

    def __init__(self, controller: Controller, on_drop: Callable[[torch.Tensor], None] | None = None) -> None:
        self.controller = controller
        self.on_drop = on_drop or (lambda ids: None)
        self.closed = False
        self._changed = asyncio.Event()

    # -- notification ----------------------------------------------------------

    def notify(self) -> None:
        """Wake every waiter (they re-check their condition)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def check_open(self) -> None:
        """``StoreClosedError`` once the store is closed."""
        if self.closed:
            raise StoreClosedError("the store is closed; create a new one (or reconnect to a running server)")

    def _expire(self, now: float) -> None:
        expired, _ = self.controller.expire(now)
        if expired:
            self.notify()

    async def wait_until(self, attempt: Callable[[], T | None], timeout: float | None,
                         timed_out: Callable[[], str]) -> T:
        """Retry ``attempt`` until it returns non-None, waiting between tries for a change (:meth:`notify`),
        the next lease deadline or ``timeout`` (then ``StoreTimeoutError(timed_out())``); a closed store
        raises ``StoreClosedError``. ``attempt`` runs with no await inside, so it sees one consistent state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check_open()
            event = self._changed
            result = attempt()
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise StoreTimeoutError(timed_out())
            await self._wait(event, deadline)

    async def _wait(self, event: asyncio.Event, deadline: float | None) -> None:
        """Wait for a change, the next lease deadline (to expire it), or ``deadline``; whichever first."""
        now = time.monotonic()
        limits = [t for t in (deadline, self.controller.next_deadline()) if t is not None]
        wait_s = max(0.0, min(limits) - now) if limits else None
        waiter = asyncio.ensure_future(event.wait())
        try:
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation (see inprocess.py)
            await asyncio.wait((waiter,), timeout=wait_s)
        finally:
            waiter.cancel()

    # -- control calls ---------------------------------------------------------

    def register_task(
        self, task: str, consumes: Sequence[str] = (), produces: Sequence[str] = (), partition: str | None = None
    ) -> None:
        self.check_open()
        self.controller.register_task(task, consumes, produces, partition)
        self.notify()

    async def add_rows(
        self, n: int, partition: str, group_ids: Any, block: bool, timeout: float | None
    ) -> torch.Tensor:
        """New row ids; waits for capacity when ``block`` (``StoreTimeoutError`` after ``timeout``)."""

        def attempt() -> torch.Tensor | None:
            try:
                return self.controller.add_rows(n, partition, group_ids)
            except StoreFullError:
                if not block:
                    raise
                return None

        return await self.wait_until(attempt, timeout, lambda: (
            f"put of {n} rows waited {timeout}s for space (capacity {self.controller.capacity}); "
            "acknowledge rows faster, raise the capacity, or pass a longer timeout"))

    def mark_ready(self, row_ids: torch.Tensor, columns: Sequence[str], versions: Any, num_tokens: Any) -> None:
        self.controller.mark_ready(row_ids, columns, versions, num_tokens)
        self.notify()

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
        self.check_open()
        columns = tuple(columns)
        self.controller.validate_request(task, columns, batch_size, dp_rank, dp_size, lease_s, partition)

        def attempt() -> BatchMeta | None:
            now = time.monotonic()
            self._expire(now)
            meta = self.controller.try_lease(
                task, columns, batch_size, sampler, min_version, partition, partial, lease_s, consumer,
                dp_rank, dp_size, now,
            )
            if meta is not None and len(meta):
                self.notify()  # other DP ranks may claim their parts now
            return meta

        return await self.wait_until(attempt, timeout, lambda: (
            f"get_meta(task={task!r}, columns={list(columns)}, batch_size={batch_size}) found no batch "
            f"within {timeout}s; check that a producer writes these columns, or pass a longer timeout"))

    def _lease_id(self, meta: BatchMeta, verb: str) -> int:
        if not isinstance(meta, BatchMeta) or meta.lease_id is None:
            raise LeaseError(f"cannot {verb} this meta: it is not a lease; pass a meta that get_meta() returned")
        return int(meta.lease_id)

    def ack(self, meta: BatchMeta) -> int:
        self.check_open()
        lid = self._lease_id(meta, "acknowledge")
        try:
            done, dropped = self.controller.ack_and_collect(lid, time.monotonic())
        finally:
            self.notify()  # an expired lease freed rows even when ack raised
        if dropped.numel():
            self.on_drop(dropped)
        return done

    def release(self, meta: BatchMeta) -> int:
        self.check_open()
        freed = self.controller.release(self._lease_id(meta, "release"), time.monotonic())
        self.notify()
        return freed

    def renew(self, meta: BatchMeta, lease_s: float | None = None) -> float | None:
        """The lease's new deadline, or None once it is no longer held (see ``StreamStore.renew``)."""
        self.check_open()
        lid = self._lease_id(meta, "renew")
        if self.controller.renew(lid, lease_s, time.monotonic()):
            return self.controller.lease_info(lid)["deadline"]
        self.notify()  # the call may have expired it (its deadline had passed): its rows are free
        return None

    def declare_dead(self, consumer: str) -> int:
        self.check_open()
        freed = self.controller.declare_dead(consumer)
        self.notify()
        return freed

    def end_stream(self, partition: str | None = None) -> None:
        self.check_open()
        self.controller.end_stream(partition)
        self.notify()

    def clear(self, partition: str | None = None) -> int:
        self.check_open()
        dropped = self.controller.clear(partition)
        if dropped.numel():
            self.on_drop(dropped)
        self.notify()
        return int(dropped.numel())

    def close(self) -> None:
        self.closed = True
        self.notify()


def rows_of(columns: dict[str, Any]) -> int:
    """Rows a put writes (taken from its first column); ``InvalidRequestError`` for an empty put."""
    from asyncflow_core.types.batch import column_rows

    if not columns:
        raise InvalidRequestError("put() needs at least one column; pass {name: tensor or RaggedTensor}")
    try:
        return column_rows(next(iter(columns.values())))
    except Exception as exc:
        from asyncflow_core.store.errors import ColumnTypeError

        raise ColumnTypeError(f"cannot count the rows of column {next(iter(columns))!r}: {exc}") from exc


def check_versions(versions: Any, n: int) -> torch.Tensor | None:
    """Validate ``versions`` before anything is mutated (the controller would check it only after rows exist)."""
    if versions is None:
        return None
    v = torch.as_tensor(versions, dtype=torch.int64)
    if v.dim() == 1:
        v = torch.stack([v, v], dim=1)
    if v.shape != (n, 2) or bool((v < 0).any()) or bool((v[:, 0] > v[:, 1]).any()):
        raise InvalidRequestError(
            f"versions must be non-negative with shape [{n}, 2] (min <= max policy version per row) or [{n}]"
        )
    return v


def num_tokens_of(columns: dict[str, Any], token_columns: Sequence[str]) -> torch.Tensor | None:
    """Per-row token count: the summed lengths of the ``token_columns`` written (None when none is)."""
    from asyncflow_core.types import RaggedTensor

    lengths = [c.lengths for n, c in columns.items() if n in token_columns and isinstance(c, RaggedTensor)]
    if not lengths:
        return None
    return torch.stack(lengths).sum(0)


def split_column(name: Any, col: Any, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, lengths or None)`` of one put column, after checking its name, type and row count."""
    from asyncflow_core.store.errors import ColumnTypeError
    from asyncflow_core.types import RaggedTensor

    if not isinstance(name, str) or not name:
        raise ColumnTypeError(f"column names must be non-empty strings, got {name!r}")
    if isinstance(col, RaggedTensor):
        values, lengths, rows_here = col.values, col.lengths, len(col)
    elif isinstance(col, torch.Tensor):
        if col.dim() == 0:
            raise ColumnTypeError(f"dense column {name!r} needs a leading row dimension; got a 0-d tensor")
        values, lengths, rows_here = col, None, int(col.shape[0])
    else:
        raise ColumnTypeError(f"column {name!r} must be a torch.Tensor (dense) or a RaggedTensor, got {type(col).__name__}")
    if rows_here != n:
        raise ColumnTypeError(
            f"column {name!r} holds {rows_here} rows but {n} rows are being written; "
            "give every column one value (or sequence) per row"
        )
    return values, lengths
