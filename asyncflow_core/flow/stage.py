"""The stage contract: a loop that leases rows, reads columns, computes, writes columns and acknowledges.

A :class:`Stage` declares the columns it ``consumes`` and ``produces``; the
runtime registers it as a store task and runs :meth:`Stage.run` as one
asyncio task. Most stages only implement :meth:`Stage.process` (a batch in,
columns out) and inherit the loop; the rollout and train stages override
``run`` because they schedule engines.

Rows a stage fails on are not lost and do not stop the pipeline: the stage
writes placeholder values for its outputs, the row is settled as failed
(with the error) in the context's :class:`~asyncflow_core.flow.outcomes.RowOutcomes`,
later stages skip it, and the trainer drops its prompt group (counted). A
failure rate above ``pipeline.max_failure_rate`` stops the run with a clear
message.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import AsyncflowError
from asyncflow_core.flow.events import Events, VersionPublished
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.outcomes import RowOutcomes, merge_outputs
from asyncflow_core.flow.staleness import TailPolicy
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.types import Batch, Column, RaggedTensor

log = logging.getLogger("asyncflow.flow")

#: :meth:`FlowContext.notify`'s default key: anything may have changed, every waiter looks again
EVERY: Any = object()
#: the key of a notify after which only the ledger changed (groups re-queued or dropped): no replica's weights
LEDGER = "ledger"
#: a task in :meth:`FlowContext.wait_for`: (registration order, predicate, future)
_Waiter = tuple[int, Callable[[], bool], asyncio.Future]


#: Kind and dtype of the standard columns, and those with one value per response token (asyncflow_core/columns.py)
STANDARD_COLUMN_TYPES = C.STANDARD_COLUMN_TYPES
PER_RESPONSE_TOKEN = C.PER_RESPONSE_TOKEN
_RESPONSE_IDS = C.RESPONSE_IDS


async def unless(work: Awaitable[Any], stop: Awaitable[Any]) -> Any:
    """``work``'s result, or None when ``stop`` completes first (``work`` is then cancelled). A result that is
    ready together with ``stop`` is returned, not lost; cancelling the caller cancels both."""
    task, halt = asyncio.ensure_future(work), asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        return None

class RunStopped(AsyncflowError):
    """The run was stopped (failure-rate limit, a dead engine pool, or a fatal stage error); the message says why."""

    exit_code = 1


@dataclass
class FlowContext:
    """What every stage of one run shares."""

    store: StreamStore
    timeline: Timeline
    ledger: Ledger
    k: int  #: staleness bound
    prompts_per_step: int  #: B
    n: int  #: samples per prompt
    clock: Callable[[], float]
    stale_policy: str = "requeue"  #: requeue | drop
    tail: TailPolicy = field(default_factory=TailPolicy)  #: over-provisioning, staleness basis, stale tails
    max_failure_rate: float = 0.2
    lease_s: float | None = None  #: lease on rows a stage holds when the stage sets none (None: the store's default)
    min_samples_for_rate: int = 32
    version: int = 0  #: trainer version (published weights)
    published: int = 0  #: newest version staged in the weight transport
    counters: Counter[str] = field(default_factory=Counter)
    processed: Counter[str] = field(default_factory=Counter)  #: rows processed per stage
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_reason: str | None = None
    listeners: list[asyncio.Event] = field(default_factory=list)  #: also set on every notify and on halt
    #: tasks in :meth:`wait_for` with no key: (order, predicate, future); every :meth:`notify` looks at them
    waiting: list[_Waiter] = field(default_factory=list, repr=False)
    #: tasks in :meth:`wait_for` with a key (one replica's weight-follow task): key -> its waiters
    waiting_on: dict[Any, list[_Waiter]] = field(default_factory=dict, repr=False)
    _order: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _published_checked: int = field(default=0, repr=False)  #: ``published`` at the last notify of every waiter
    outcomes: RowOutcomes = field(init=False, repr=False)  #: rows settled failed, filtered or stale
    events: Events = field(default_factory=Events, repr=False)  #: run events (flow/events.py)

    def __post_init__(self) -> None:
        self.outcomes = RowOutcomes(lambda: self.counters)
        self.events.subscribe(VersionPublished, lambda _: self.notify(), name="context")  # always first

    async def notify(self, key: Any = EVERY) -> None:
        """Version, published weights or the ledger changed: wake the listeners and the waiters now satisfied.

        ``key``: only the state of that key changed (one replica's weights): the waiters that passed the same key
        to :meth:`wait_for` and those that passed none look again, not every replica's weight-follow task (which
        made a weight load's wake-up cost one check per replica, quadratic in replicas over a run). Once
        ``published`` moved (which every weight-follow wait reads), the next notify of any key checks everyone.
        """
        for ev in self.listeners:
            ev.set()
        self._wake_satisfied(key)

    async def wait_for(self, predicate: Callable[[], bool], *, key: Any = None) -> None:
        """Return once ``predicate()`` holds after a :meth:`notify` (or the run stops).

        ``key`` (hashable): ``predicate`` reads nothing that changes without a :meth:`notify` of no key or of
        this key, so notifies of other keys skip it. None: every notify checks it.
        """
        while not (predicate() or self.stop.is_set()):
            fut = asyncio.get_running_loop().create_future()
            waiter = (next(self._order), predicate, fut)
            (self.waiting if key is None else self.waiting_on.setdefault(key, [])).append(waiter)
            await fut

    def _wake_satisfied(self, key: Any = EVERY) -> None:
        # predicates are checked here, not in each waiter: a run has a waiter per rollout replica, and waking
        # all of them on every change costs a task switch each. Those satisfied wake in the order they began
        # waiting, whichever keys were checked.
        if key is EVERY or self.published != self._published_checked:
            keys = list(self.waiting_on)
            self._published_checked = self.published
        else:
            keys = [key] if key in self.waiting_on else []
        ready: list[_Waiter] = []
        self.waiting = self._check(self.waiting, ready)
        for k in keys:
            still = self._check(self.waiting_on[k], ready)
            if still:
                self.waiting_on[k] = still
            else:
                del self.waiting_on[k]
        ready.sort(key=lambda w: w[0])
        for _, _, fut in ready:
            fut.set_result(None)

    def _check(self, waiters: list[_Waiter], ready: list[_Waiter]) -> list[_Waiter]:
        """Move the waiters whose predicate holds (or whose predicate raised) to ``ready``; return the rest."""
        still = []
        for w in waiters:
            if w[2].done():
                continue  # its task was cancelled
            try:
                ok = self.stop.is_set() or w[1]()
            except Exception:  # noqa: BLE001 - the waiter evaluates it again and raises in its own task
                ok = True
            (ready if ok else still).append(w)
        return still

    def fail_rows(self, stage: str, row_ids: Sequence[int], error: str) -> None:
        self.outcomes.fail(stage, row_ids, error)
        total = sum(self.processed.values())
        failures = self.outcomes.failures()
        if total >= self.min_samples_for_rate and failures / total > self.max_failure_rate:
            self.halt(
                f"{failures} of {total} rows failed (> pipeline.max_failure_rate={self.max_failure_rate}); "
                f"last error in stage {stage!r}: {error}. Fix the stage or raise the limit"
            )

    def halt(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stop.set()
        for ev in self.listeners:
            ev.set()
        self._wake_satisfied()


@dataclass(frozen=True)
class StageOutput:
    """What :meth:`Stage.process` returns: columns for every input row, optional version ranges."""

    columns: Mapping[str, Column]
    versions: torch.Tensor | None = None
    drop: torch.Tensor | None = None  #: bool per row: filter these samples out (their groups are dropped, counted)


class Stage(abc.ABC):
    """One RL task as a store consumer/producer. Subclasses set the class attributes or override them."""

    name: str = "stage"  #: store task name and telemetry lane
    consumes: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    batch_size: int = 32  #: rows per lease (a lease returns fewer when ``partial``)
    sampler: str | None = "fifo"
    partial: bool = True
    concurrency: int = 1  #: leases processed at once
    span_name: str = "process"
    lease_s: float | None = None  #: lease on the rows it holds (None: the run's ``pipeline.lease_s``)
    #: kind (``"dense"`` or ``"ragged"``) and dtype of each produced column that is not a standard one and not dense
    #: float32; :meth:`placeholder` writes failed rows in them (e.g. ``{"n_tool_calls": ("dense", torch.int64)}``)
    column_types: Mapping[str, tuple[str, torch.dtype]] = {}

    ctx: FlowContext

    def bind(self, ctx: FlowContext) -> None:
        self.ctx = ctx

    def lease(self) -> float | None:
        """The lease this stage asks for: its own :attr:`lease_s`, else the run's (``pipeline.lease_s``)."""
        return self.lease_s if self.lease_s is not None else self.ctx.lease_s

    async def setup(self) -> None:
        """Called once before the loop (engines are already set up)."""

    async def process(self, batch: Batch) -> StageOutput:
        """Compute the produced columns for ``batch`` (rows failed upstream are already excluded)."""
        raise NotImplementedError

    def placeholder(self, batch: Batch) -> dict[str, Column]:
        """Outputs written for failed rows: zeros in each produced column's kind and dtype.

        The kind and dtype of a column come from :attr:`column_types`, else
        from the standard columns' table (:data:`STANDARD_COLUMN_TYPES`), else
        dense float32 (one value per row). A ragged column gets, per row, one
        zero per response token when it is a per-token column and the batch
        holds ``response_ids``, else an empty sequence. Override for anything
        else (a dense vector per row, other fill values).
        """
        n = batch.num_rows
        resp = batch.get(_RESPONSE_IDS)
        out: dict[str, Column] = {}
        for col in self.produces:
            kind, dtype = self.column_types.get(col) or STANDARD_COLUMN_TYPES.get(col) or ("dense", torch.float32)
            if kind == "dense":
                out[col] = torch.zeros(n, dtype=dtype)
            elif col in PER_RESPONSE_TOKEN and isinstance(resp, RaggedTensor):
                out[col] = RaggedTensor(torch.zeros(resp.numel_packed, dtype=dtype), resp.offsets)
            else:
                out[col] = RaggedTensor(torch.zeros(0, dtype=dtype), torch.zeros(n + 1, dtype=torch.int64))
        return out

    async def run(self) -> None:
        """The default loop; ``concurrency`` copies run side by side."""
        await asyncio.gather(*(self._loop(i) for i in range(self.concurrency)))

    async def _loop(self, worker: int) -> None:
        ctx = self.ctx
        store = ctx.store
        lane = self.name if self.concurrency == 1 else f"{self.name}/{worker}"
        while not ctx.stop.is_set():
            meta = await store.get_meta(self.name, self.consumes, self.batch_size, sampler=self.sampler,
                                        partial=self.partial, consumer=f"{self.name}/{worker}", lease_s=self.lease())
            if meta.end_of_stream:
                return
            with ctx.timeline.span(lane, self.span_name):
                batch = await store.get(meta)
                await self.handle(meta, batch)
            await store.ack(meta)

    async def handle(self, meta: BatchMeta, batch: Batch) -> None:
        """Process ``batch``, isolating failing rows, and write the outputs to ``meta``'s rows."""
        out_cols, versions = await self.outputs(meta.row_ids, batch)
        await self.ctx.store.put(out_cols, rows=meta, versions=versions)

    async def outputs(self, row_ids: torch.Tensor, batch: Batch) -> tuple[dict[str, Column], torch.Tensor | None]:
        """The produced columns (and version ranges, or None) for every row of ``batch``, whose store rows are
        ``row_ids``: :meth:`process` on the rows not failed upstream, placeholders for the others and for rows
        that raise. What :meth:`handle` writes; the rollout stage's writer calls it directly for an inline
        reward (flow/reward_inline.py)."""
        ctx = self.ctx
        good = (~ctx.outcomes.mask(row_ids)).nonzero().squeeze(1)
        out_cols: dict[str, Column] | None = None
        versions = None
        if good.numel():
            sub = batch if good.numel() == batch.num_rows else batch.select(good)
            try:
                res = await self.process(sub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - isolate the failing rows below
                res = await self._rowwise(sub, exc)
            if res.drop is not None:
                ctx.outcomes.filter(self.name, (sub.row_ids if sub.row_ids is not None
                                                else row_ids[good])[res.drop.to(torch.bool)])
            if good.numel() == batch.num_rows:
                out_cols, versions = dict(res.columns), res.versions
            else:
                out_cols = merge_outputs(batch, good, res.columns, self.placeholder(batch))
        else:
            out_cols = self.placeholder(batch)
        ctx.processed[self.name] += int(good.numel())
        return out_cols, versions

    async def _rowwise(self, batch: Batch, first: Exception) -> StageOutput:
        """Retry a failed batch one row at a time; rows that still raise are recorded failed."""
        parts: list[dict[str, Column]] = []
        ids = batch.row_ids if batch.row_ids is not None else torch.arange(batch.num_rows)
        for i in range(batch.num_rows):
            one = batch.select(torch.tensor([i]))
            try:
                parts.append(dict((await self.process(one)).columns))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded per row
                self.ctx.fail_rows(self.name, [int(ids[i])], f"{type(exc).__name__}: {exc}")
                parts.append(self.placeholder(one))
        log.debug("stage %s: batch failed (%s); retried row by row", self.name, first)
        return StageOutput(_cat_columns(parts))


def _cat_columns(parts: list[dict[str, Column]]) -> dict[str, Column]:
    out: dict[str, Column] = {}
    for name in parts[0]:
        cols = [p[name] for p in parts]
        out[name] = RaggedTensor.cat(cols) if isinstance(cols[0], RaggedTensor) else torch.cat(cols)  # type: ignore[arg-type]
    return out

