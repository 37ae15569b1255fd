"""The store's control plane: which rows exist, what is ready, who holds what.

:class:`Controller` is synchronous, single-threaded and holds no column data:
deployments wrap it (in-process under a lock, or behind an RPC server / a Ray
actor) and pair it with one or more :class:`~asyncflow_core.store.storage.StorageUnit`.
Every argument and result is picklable (tensors, numbers, strings, tuples,
:class:`~asyncflow_core.interfaces.BatchMeta`), and time is always passed in
(``now``), so a remote controller and a test with a fake clock behave alike.

Public methods (stable):

- ``register_task(task, consumes=(), produces=(), partition=None)``  (``partition``: the task's scope, see below)
- ``task_partition(task) -> str | None``  (the partition a task is scoped to; None = every partition)
- ``add_rows(n, partition="default", group_ids=None) -> Tensor``  (new row ids; ``StoreFullError``)
- ``check_rows(row_ids) -> None``  (``UnknownRowError`` unless all live)
- ``live_mask(row_ids) -> Tensor``  (bool per id: is it a live row)
- ``drop_rows(row_ids) -> Tensor``  (drop the live ones now, with leases left holding no row; dropped ids)
- ``mark_ready(row_ids, columns, versions=None, num_tokens=None)``
- ``mark_new_ready(row_ids, columns, versions=None, num_tokens=None)``  (``mark_ready`` of the ids the last
  ``add_rows`` returned, before anything else changed them: a put of new rows; any other ids take ``mark_ready``)
- ``validate_request(task, columns, batch_size, dp_rank=0, dp_size=1, lease_s=None, partition=None)``
- ``try_lease(task, columns, batch_size, sampler, min_version, partition, partial, lease_s,
  consumer, dp_rank, dp_size, now) -> BatchMeta | None``
- ``is_end_of_stream(task, columns, min_version=None, partition=None) -> bool``
- ``ack(lease_id, now=None) -> int`` / ``release(lease_id, now=None) -> int``
- ``ack_and_collect(lease_id, now=None) -> tuple[int, Tensor]``  (``ack``, then ``gc`` of its rows: rows
  acknowledged, dropped ids)
- ``renew(lease_id, lease_s=None, now=None) -> bool``  (a live lease's deadline becomes ``now + lease_s``; False: gone)
- ``expire(now) -> tuple[list[int], float | None]``  (expired lease ids, next deadline)
- ``next_deadline() -> float | None``
- ``any_ready(row_ids, columns) -> bool``  (after a write: can a blocked lease of ``columns`` now succeed?)
- ``whole_group_size(sampler) -> int`` / ``may_complete_group(row_ids, columns, task, group_size) -> bool``
  (the same question for a sampler that hands out whole groups only: did the write complete a group?)
- ``declare_dead(consumer) -> int``
- ``end_stream(partition=None)`` / ``stream_ended(partition=None) -> bool``
- ``gc(row_ids=None) -> Tensor``  (dropped row ids, for storage to free)
- ``clear(partition=None) -> Tensor``  (dropped row ids)
- ``state_dict() -> dict`` / ``load_state_dict(state)``  (outstanding leases come back free)
- ``lease_info(lease_id) -> dict | None`` / ``lease_task(lease_id) -> str | None``; module function ``normalize_versions(versions, n)``
- ``stats() -> dict[str, int]``
- properties ``capacity``, ``num_live``, ``tasks``

Partition scope: a task registered with ``partition=P`` consumes only rows of
partition ``P``: a lease with ``partition=None`` sees only ``P``'s rows (asking
for another partition is an ``InvalidRequestError``), its end of stream is
``P``'s, and ``gc`` collects a row once every consumer task whose scope covers
the row's partition (scoped to it, or unscoped) acknowledged it. Unscoped tasks
(the default) see and hold every partition, as before. Rows of a partition no
consumer covers are never collected.

Layout: per row, flat tensors in arrival order (row ids increase with the
slot, so a row id is found by binary search and candidates come out oldest
first without sorting); a ready bitmask per row (63 columns per int64 word);
per task an int8 state (free/leased/done) and an int64 lease id. Dropped rows
are marked dead and compacted away once they are the majority, so ``gc`` is
O(rows acknowledged) and compaction is amortised. Per task and column set a
bool per row (free, alive, ready) is kept up to date by every change, so a
lease attempt reads one column instead of re-deriving it.
"""

from __future__ import annotations

import collections
import functools
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncflow_core.interfaces.sampler import Candidates, Sampler, SampleRequest
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store.errors import (
    InvalidRequestError,
    LeaseError,
    StoreFullError,
    UnknownColumnError,
    UnknownRowError,
)
from asyncflow_core.store.indexing import count_nonzero

FREE, LEASED, DONE = 0, 1, 2
_BITS_PER_WORD = 63  # keep clear of the sign bit so masks stay plain positive Python ints
_FINISHED_LEASES_KEPT = 65536  # how many finished lease ids we remember, to explain a late ack
_MIN_COMPACT = 256
_SCAN_CHUNK = 1 << 16  # rows scanned per step when looking for the oldest candidates


@dataclass
class _Task:
    index: int
    consumes: tuple[str, ...]
    produces: tuple[str, ...]
    partition: str | None = None  #: the only partition the task reads and holds; None = all

    @property
    def is_consumer(self) -> bool:
        return bool(self.consumes)


@dataclass
class _Lease:
    task: str
    row_ids: torch.Tensor
    columns: tuple[str, ...]
    deadline: float
    consumer: str | None
    lease_s: float
    reserved: bool = False  # a DP part formed for a rank that has not claimed it yet
    #: the rows' slots when granted, valid while the controller's slot generation is ``slots_gen`` (an ack
    #: with no put, drop or compaction since the grant finds its rows without a search)
    slots: np.ndarray | None = None
    slots_gen: int = -1


@dataclass
class _DPRound:
    """One global pick split across ``dp_size`` ranks; ``parts[r]`` is rank r's lease id (None once claimed)."""

    parts: list[int | None] = field(default_factory=list)


def _as_ids(row_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(row_ids, torch.Tensor) and row_ids.dtype == torch.int64 and row_ids.dim() == 1 and row_ids.is_cpu:
        return row_ids  # what as_tensor and reshape would return (the same memory), without their dispatch
    return torch.as_tensor(row_ids, dtype=torch.int64, device="cpu").reshape(-1)


def normalize_versions(versions: torch.Tensor | Sequence | None, n: int) -> torch.Tensor | None:
    """``versions`` as an [n, 2] int64 (min, max) tensor; a 1-D [n] tensor means min == max.

    Raises ``InvalidRequestError`` for a wrong shape, negative versions or min > max.
    """
    if versions is None:
        return None
    v = torch.as_tensor(versions, dtype=torch.int64, device="cpu")
    if v.dim() == 1:
        v = torch.stack([v, v], dim=1)
    if tuple(v.shape) != (n, 2):
        raise InvalidRequestError(
            f"versions must have shape [{n}, 2] (min and max policy version per row) or [{n}], got {tuple(v.shape)}"
        )
    a = v.numpy()  # the checks in numpy: no torch call (store/indexing.py)
    if bool((a < 0).any()) or bool((a[:, 0] > a[:, 1]).any()):
        raise InvalidRequestError("versions must be non-negative with min <= max per row")
    return v


def has_repeats(ids: torch.Tensor | np.ndarray) -> bool:
    """Whether a 1-D int tensor (or numpy array) holds a value twice (strictly increasing ids, the usual case,
    skip the sort)."""
    a = ids if isinstance(ids, np.ndarray) else ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()
    if a.size < 2:
        return False
    if not count_nonzero(a[1:] <= a[:-1]):
        return False
    return np.unique(a).size != a.size


@functools.lru_cache(maxsize=256)
def _request(batch_size: int, partial: bool) -> SampleRequest:
    """The (frozen, so shareable) single-rank request of a lease attempt; the same few on every attempt."""
    return SampleRequest(batch_size, partial, 0, 1)


def _grow(t: torch.Tensor, cap: int, fill: int = 0) -> torch.Tensor:
    out = torch.full((cap, *t.shape[1:]), fill, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class Controller:
    """Row bookkeeping for one store: readiness, per-task leases, versions, capacity and end of stream.

    ``capacity`` bounds live rows (rows put and not yet collected).
    ``group_size`` is reported to samplers as :attr:`Candidates.group_size`
    (rows per complete prompt group; 0 = ungrouped / unknown).
    ``sampler_options`` maps a sampler name to its options when the
    controller builds it through the plugin manager. ``max_candidates``
    bounds how many eligible rows (the oldest) a sampler sees per call, at
    least ``4 * batch_size``; 0 means all. It keeps ``try_lease`` in
    milliseconds when 10^6 rows are ready.
    """

    def __init__(
        self,
        capacity: int = 65536,
        *,
        group_size: int = 0,
        sampler_options: dict[str, dict[str, Any]] | None = None,
        default_sampler: str = "fifo",
        default_lease_s: float = 600.0,
        max_candidates: int = 65536,
    ) -> None:
        if capacity < 1:
            raise InvalidRequestError(f"capacity must be at least 1, got {capacity}")
        self._capacity = int(capacity)
        self._group_size = int(group_size)
        self._sampler_options = dict(sampler_options or {})
        self._default_sampler = default_sampler
        self._default_lease_s = float(default_lease_s)
        self._max_candidates = int(max_candidates)
        self._samplers: dict[str, Sampler] = {}
        self._reset()

    # ------------------------------------------------------------------ setup

    def _reset(self) -> None:
        cap = 1024
        self._n = 0
        self._row_id = torch.zeros(cap, dtype=torch.int64)
        self._alive = torch.zeros(cap, dtype=torch.bool)
        self._partition = torch.zeros(cap, dtype=torch.int32)
        self._group = torch.full((cap,), -1, dtype=torch.int64)
        self._tokens = torch.zeros(cap, dtype=torch.int64)
        self._minv = torch.full((cap,), -1, dtype=torch.int64)
        self._maxv = torch.full((cap,), -1, dtype=torch.int64)
        self._ready = torch.zeros((cap, 1), dtype=torch.int64)
        self._state: list[torch.Tensor] = []
        self._lease_of: list[torch.Tensor] = []
        #: (task index, needed ready masks) -> bool per slot: free for the task, alive, ready for those columns.
        #: Built on a task's first lease of those columns and kept up to date by every change of state,
        #: liveness or readiness, so a lease attempt costs one pass over a bool column instead of a pass
        #: per condition (a run retries leases thousands of times while few rows change in between).
        self._eligible_cache: dict[tuple[int, tuple[tuple[int, int], ...]], np.ndarray] = {}
        #: the last ids whose slots were all found, and those slots (numpy): a put or an ack resolves the same ids
        #: two or three times in a row (check, mark ready, wake; ack, gc). Any change of which rows live
        #: where (add, drop, compaction, reset) bumps the generation and so drops it.
        self._slots_memo: tuple[int, np.ndarray, np.ndarray] | None = None
        self._slots_gen = getattr(self, "_slots_gen", 0) + 1
        #: (ids tensor, slots slice, generation) of the last add_rows while its rows are as it left them (no
        #: column ready, every task free): :meth:`mark_new_ready` then writes them without reading them
        self._fresh: tuple[torch.Tensor, slice, int] | None = None
        self._tasks: dict[str, _Task] = {}
        self._produced_cache: frozenset[str] | None = None  #: every registered task's produces; None: stale
        self._consumers_cache: list[_Task] | None = None  #: the tasks that consume a column; None: stale
        self._columns: dict[str, int] = {}
        self._needs_cache: dict[tuple[str, ...], tuple[tuple[int, int], ...]] = {}  #: see _need_masks
        self._partitions: dict[str, int] = {}
        self._ended: set[str] = set()
        self._ended_all = False
        self._leases: dict[int, _Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  #: heap of (deadline, lease id); stale entries skipped lazily
        self._finished: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._dp_rounds: dict[tuple, list[_DPRound]] = {}
        #: group id -> (first, last) row id put with it: where a group's rows lie, for ``may_complete_group``
        #: (a group's rows are usually put together, so the span is the group; entries whose last row was
        #: collected are pruned at compaction)
        self._group_span: dict[int, tuple[int, int]] = {}
        self._next_row_id = 0
        self._next_lease_id = 1
        self._live = 0
        self._dead = 0
        self._counters = {"rows_put": 0, "rows_done": 0, "rows_dropped": 0, "leases_expired": 0, "leases_granted": 0,
                          "leases_renewed": 0}
        self._views()

    def _views(self) -> None:
        """Numpy views of the row tables (``Tensor.numpy()`` shares their memory), taken once per allocation.

        Every hot path reads and writes the tables through these: a ``.numpy()`` per access cost about 1 µs,
        and a put/lease/read/ack loop made 150 of them. Call after any table is replaced (reset, growth, a
        new ready word or task); in-place writes through either side are seen by the other.
        """
        self._row_id_np = self._row_id.numpy()
        self._alive_np = self._alive.numpy()
        self._partition_np = self._partition.numpy()
        self._group_np = self._group.numpy()
        self._tokens_np = self._tokens.numpy()
        self._minv_np = self._minv.numpy()
        self._maxv_np = self._maxv.numpy()
        self._ready_np = self._ready.numpy()
        self._state_np = [s.numpy() for s in self._state]
        self._lease_of_np = [s.numpy() for s in self._lease_of]

    @property
    def capacity(self) -> int:
        """Most live rows the store holds at once."""
        return self._capacity

    @property
    def num_live(self) -> int:
        """Rows put and not yet collected or cleared."""
        return self._live

    @property
    def tasks(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """Registered tasks: name -> (consumes, produces)."""
        return {name: (t.consumes, t.produces) for name, t in self._tasks.items()}

    def _alloc(self) -> int:
        return self._row_id.shape[0]

    def _ensure_slots(self, needed: int) -> None:
        cap = self._alloc()
        if needed <= cap:
            return
        new = max(needed, 2 * cap)  # amortised doubling
        self._row_id = _grow(self._row_id, new)
        self._alive = _grow(self._alive, new)
        self._partition = _grow(self._partition, new)
        self._group = _grow(self._group, new, -1)
        self._tokens = _grow(self._tokens, new)
        self._minv = _grow(self._minv, new, -1)
        self._maxv = _grow(self._maxv, new, -1)
        self._ready = _grow(self._ready, new)
        self._state = [_grow(s, new) for s in self._state]
        self._lease_of = [_grow(s, new) for s in self._lease_of]
        self._eligible_cache.clear()
        self._views()

    def _column_bit(self, name: str) -> int:
        bit = self._columns.get(name)
        if bit is None:
            bit = len(self._columns)
            self._columns[name] = bit
            words = bit // _BITS_PER_WORD + 1
            if words > self._ready.shape[1]:
                extra = torch.zeros((self._ready.shape[0], words - self._ready.shape[1]), dtype=torch.int64)
                self._ready = torch.cat([self._ready, extra], dim=1)
                self._ready_np = self._ready.numpy()
        return bit

    def _need_masks(self, columns: Sequence[str]) -> tuple[tuple[int, int], ...]:
        """(word, mask) pairs a row's ready bits must cover; columns never written get a bit now (never ready).

        Kept per column tuple (a column's bit never changes until a reset): every put, lease and wake-up check
        asks for the same few sets."""
        key = columns if isinstance(columns, tuple) else tuple(columns)
        out = self._needs_cache.get(key)
        if out is None:
            masks: dict[int, int] = {}
            for c in key:
                bit = self._column_bit(c)
                w, b = divmod(bit, _BITS_PER_WORD)
                masks[w] = masks.get(w, 0) | (1 << b)
            out = self._needs_cache[key] = tuple(sorted(masks.items()))
        return out

    def _partition_id(self, name: str) -> int:
        pid = self._partitions.get(name)
        if pid is None:
            pid = len(self._partitions)
            self._partitions[name] = pid
        return pid

    # ------------------------------------------------------------------ tasks

    def register_task(
        self, task: str, consumes: Sequence[str] = (), produces: Sequence[str] = (), partition: str | None = None
    ) -> None:
        """Declare ``task``; registering again adds to its columns. A task that consumes columns must
        acknowledge every row of its scope before the row is collected.

        ``partition`` scopes the task to one partition (None: every partition).
        The scope is fixed by the first registration that names one; registering
        again with ``partition=None`` keeps it, with another partition raises
        ``InvalidRequestError``.
        """
        if not isinstance(task, str) or not task:
            raise InvalidRequestError(f"task must be a non-empty string, got {task!r}")
        if partition is not None and (not isinstance(partition, str) or not partition):
            raise InvalidRequestError(f"partition must be a non-empty string or None, got {partition!r}")
        consumes, produces = tuple(consumes), tuple(produces)
        for c in (*consumes, *produces):
            if not isinstance(c, str) or not c:
                raise InvalidRequestError(f"column names must be non-empty strings, got {c!r} for task {task!r}")
        existing = self._tasks.get(task)
        self._produced_cache = self._consumers_cache = None
        if existing is not None:
            if partition is not None and existing.partition != partition:
                scope = "every partition" if existing.partition is None else f"partition {existing.partition!r}"
                raise InvalidRequestError(
                    f"task {task!r} is registered for {scope}; it cannot be re-registered for partition "
                    f"{partition!r}. Register a task per partition under its own name"
                )
            existing.consumes = tuple(dict.fromkeys((*existing.consumes, *consumes)))
            existing.produces = tuple(dict.fromkeys((*existing.produces, *produces)))
        else:
            self._tasks[task] = _Task(len(self._state), consumes, produces, partition)
            if partition is not None:
                self._partition_id(partition)
            self._state.append(torch.zeros(self._alloc(), dtype=torch.int8))
            self._lease_of.append(torch.zeros(self._alloc(), dtype=torch.int64))
            self._views()
        for c in (*consumes, *produces):
            self._column_bit(c)

    def _task(self, task: str) -> _Task:
        t = self._tasks.get(task)
        if t is None:
            known = ", ".join(sorted(self._tasks)) or "none"
            raise InvalidRequestError(
                f"unknown task {task!r} (registered: {known}); call register_task({task!r}, consumes=...) first"
            )
        return t

    def task_partition(self, task: str) -> str | None:
        """The partition ``task`` is scoped to (None: every partition); ``InvalidRequestError`` if unknown."""
        return self._task(task).partition

    def _scope(self, t: _Task, partition: str | None) -> str | None:
        """The partition a request of ``t`` reads: its own scope, or ``partition`` for an unscoped task."""
        if t.partition is None:
            return partition
        if partition is not None and partition != t.partition:
            raise InvalidRequestError(
                f"task of partition {t.partition!r} cannot lease rows of partition {partition!r}; pass "
                f"partition=None (or {t.partition!r}), or register a task for {partition!r}"
            )
        return t.partition

    def _produced(self) -> frozenset[str]:
        out = self._produced_cache
        if out is None:  # asked on every lease attempt; changes only when a task is registered
            out = self._produced_cache = frozenset(c for t in self._tasks.values() for c in t.produces)
        return out

    # ------------------------------------------------------------------ rows

    def add_rows(
        self,
        n: int,
        partition: str = "default",
        group_ids: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Allocate ``n`` new rows in ``partition``; returns their (increasing) row ids.

        Raises ``StoreFullError`` when they do not fit under ``capacity`` now,
        ``InvalidRequestError`` when they never could or the partition's stream ended.
        """
        n = int(n)
        if n < 1:
            raise InvalidRequestError(f"add_rows needs at least one row, got {n}")
        if n > self._capacity:
            raise InvalidRequestError(
                f"cannot put {n} rows into a store of capacity {self._capacity}; put fewer rows at a time "
                "or raise the store's capacity"
            )
        if self._ended_all or partition in self._ended:
            raise InvalidRequestError(
                f"the stream of partition {partition!r} has ended (end_stream was called); no new rows can be put"
            )
        groups = None
        if group_ids is not None:
            groups = _as_ids(group_ids)
            if groups.numel() != n:
                raise InvalidRequestError(f"group_ids has {groups.numel()} entries for {n} rows; give one per row")
        if self._live + n > self._capacity:
            raise StoreFullError(
                f"store is full: {self._live} live rows + {n} new > capacity {self._capacity}. Acknowledge or "
                "clear rows, put with block=True to wait, or raise the capacity"
            )
        pid = self._partition_id(partition)
        self._ensure_slots(self._n + n)
        s = slice(self._n, self._n + n)
        ids_np = np.arange(self._next_row_id, self._next_row_id + n, dtype=np.int64)
        self._row_id_np[s] = ids_np
        self._alive_np[s] = True
        self._partition_np[s] = pid
        self._group_np[s] = groups.numpy() if groups is not None else -1
        self._tokens_np[s] = 0
        self._minv_np[s] = -1
        self._maxv_np[s] = -1
        self._ready_np[s] = 0
        for st, lo in zip(self._state_np, self._lease_of_np, strict=True):
            st[s] = FREE
            lo[s] = 0
        for (_, needs), elig in self._eligible_cache.items():
            elig[s] = not needs  # free and alive; ready only when no column is needed
        ids = torch.from_numpy(ids_np)
        if groups is not None:
            self._note_group_spans(ids, groups)
        self._n += n
        self._next_row_id += n
        self._slots_gen += 1
        # the next calls (mark ready, the wake-up check, a lease of exactly these rows) resolve these ids
        self._slots_memo = (self._slots_gen, ids_np.copy(), np.arange(s.start, s.stop, dtype=np.int64))
        self._fresh = (ids, s, self._slots_gen)
        self._live += n
        self._counters["rows_put"] += n
        return ids

    def _note_group_spans(self, ids: torch.Tensor, groups: torch.Tensor) -> None:
        g, r = groups.numpy(), ids.numpy()
        valid = g >= 0
        if not valid.any():
            return
        g, r = g[valid], r[valid]
        uniq, inv = np.unique(g, return_inverse=True)
        inv = inv.reshape(-1)
        lo = np.full(uniq.size, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(lo, inv, r)
        hi = np.full(uniq.size, -1, dtype=np.int64)
        np.maximum.at(hi, inv, r)
        spans = self._group_span
        for gid, a, b in zip(uniq.tolist(), lo.tolist(), hi.tolist(), strict=True):
            old = spans.get(gid)
            spans[gid] = (a, b) if old is None else (min(old[0], a), max(old[1], b))

    def _slots(self, row_ids: torch.Tensor | np.ndarray, *, missing: str = "raise") -> np.ndarray:
        """Slots (an int64 numpy array, read-only for callers) of live ``row_ids``; ``missing="drop"`` silently
        skips dead or unknown ids.

        Slots stay numpy inside the controller: every table has a numpy view (:meth:`_views`), so no call
        converts between torch and numpy on the way.
        """
        a = row_ids if isinstance(row_ids, np.ndarray) else _as_ids(row_ids).numpy()
        if a.size == 0:
            return a.astype(np.int64, copy=False)
        memo = self._slots_memo
        if (memo is not None and memo[0] == self._slots_gen and memo[1].size == a.size
                and not count_nonzero(memo[1] != a)):
            return memo[2]
        # numpy: a handful of small-array ops on the calling thread, where each torch call would cost a dispatch
        # and a release of the GIL that the rollout engine's thread takes (docs/performance.md)
        if self._n == 0:
            ok = np.zeros(a.size, dtype=bool)
            pos = a
        else:
            known = self._row_id_np[: self._n]
            pos = np.searchsorted(known, a)
            np.minimum(pos, self._n - 1, out=pos)
            ok = (known[pos] == a) & self._alive_np[pos]
        if ok.all():
            self._slots_memo = (self._slots_gen, a.copy(), pos)
            return pos
        if missing == "drop":
            return pos[ok]
        bad = a[~ok][:8].tolist()
        raise UnknownRowError(
            f"unknown row ids {bad}{' ...' if int((~ok).sum()) > 8 else ''}: they were never put, or were already "
            "collected or cleared. Use the row_ids of a meta that put() or get_meta() returned"
        )

    def check_rows(self, row_ids: torch.Tensor | Sequence[int]) -> None:
        """Raise ``UnknownRowError`` unless every id names a live row (and none repeats)."""
        ids = _as_ids(row_ids)
        self._slots(ids)
        if has_repeats(ids):
            raise InvalidRequestError("row ids repeat; write each row once per call")

    def live_mask(self, row_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Bool per id of ``row_ids``: does it name a live row (put, not collected or cleared)?"""
        ids = _as_ids(row_ids)
        slots = self._slots(ids, missing="drop")
        return torch.from_numpy(np.isin(ids.numpy(), self._row_id_np[slots]))

    def mark_ready(
        self,
        row_ids: torch.Tensor | Sequence[int],
        columns: Sequence[str],
        versions: torch.Tensor | None = None,
        num_tokens: torch.Tensor | Sequence[int] | None = None,
    ) -> None:
        """Set ``columns`` ready for ``row_ids``; widen their version range by ``versions`` ([n, 2] or [n]:
        min and max policy version); set their token counts to ``num_tokens``."""
        ids = _as_ids(row_ids)
        s = self._slots(ids)
        n = ids.numel()
        v = normalize_versions(versions, n)
        self._fresh = None  # readiness changes: the rows of the last add are no longer as it left them
        tok = None
        if num_tokens is not None:
            tok = _as_ids(num_tokens)
            if tok.numel() != n:
                raise InvalidRequestError(f"num_tokens has {tok.numel()} entries for {n} rows")
        written = self._need_masks(columns)
        ready = self._ready_np  # the table updates in numpy, in place (see _slots)
        for w, mask in written:
            ready[s, w] |= mask  # slots never repeat (check_rows)
        # readiness of other columns is unchanged, so a kept mask that needs none of these stays as it is
        self._refresh_eligible(s, touching=dict(written))
        if v is not None:
            a, minv, maxv = v.numpy(), self._minv_np, self._maxv_np
            cur = minv[s]
            minv[s] = np.where(cur < 0, a[:, 0], np.minimum(cur, a[:, 0]))
            maxv[s] = np.maximum(maxv[s], a[:, 1])
        if tok is not None:
            self._tokens_np[s] = tok.numpy()

    def mark_new_ready(
        self,
        row_ids: torch.Tensor,
        columns: Sequence[str],
        versions: torch.Tensor | None = None,
        num_tokens: np.ndarray | torch.Tensor | None = None,
    ) -> None:
        """:meth:`mark_ready` of the rows the last :meth:`add_rows` returned (``row_ids`` is that very tensor),
        the first write to them (a put of new rows): their tables are written through one slice, and each
        kept eligibility is one value for all of them, since none of their columns was ready and every task
        holds them free. Any other ids, or rows changed since, take :meth:`mark_ready`."""
        fresh = self._fresh
        if fresh is None or fresh[0] is not row_ids or fresh[2] != self._slots_gen:
            self.mark_ready(row_ids, columns, versions, num_tokens)
            return
        s = fresh[1]
        n = s.stop - s.start
        v = normalize_versions(versions, n)
        tok = None
        if num_tokens is not None:
            tok = num_tokens if isinstance(num_tokens, np.ndarray) else _as_ids(num_tokens).numpy()
            if tok.size != n:
                raise InvalidRequestError(f"num_tokens has {tok.size} entries for {n} rows")
        self._fresh = None
        written = self._need_masks(columns)
        ready = self._ready_np
        bits = dict(written)
        for w, mask in written:
            ready[s, w] = mask  # add_rows left them 0
        for (_, needs), elig in self._eligible_cache.items():
            elig[s] = all(bits.get(w, 0) & need == need for w, need in needs)  # free and alive: add_rows
        if v is not None:
            a = v.numpy()
            self._minv_np[s] = a[:, 0]  # add_rows left -1 (no version yet); versions are non-negative
            self._maxv_np[s] = a[:, 1]
        if tok is not None:
            self._tokens_np[s] = tok

    def any_ready(self, row_ids: torch.Tensor | Sequence[int], columns: Sequence[str]) -> bool:
        """Whether some live row of ``row_ids`` has every one of ``columns`` ready (cheap: the rows only).

        Deployments use it after a write to wake only the blocked leases the
        write can satisfy, instead of rescanning every row for every waiter.
        """
        s = self._slots(row_ids, missing="drop")
        if s.size == 0:
            return False
        ok = np.ones(s.size, dtype=bool)
        for w, need in self._need_masks(columns):
            ok &= (self._ready_np[s, w] & need) == need
        return bool(ok.any())

    def whole_group_size(self, sampler: str | Sampler | None = None) -> int:
        """Rows per group when ``sampler`` hands out whole prompt groups only (it has a
        ``whole_group_size(store_group_size)`` method, like the built-in ``group`` sampler), else 0."""
        _, smp = self._sampler(sampler)
        size = getattr(smp, "whole_group_size", None)
        return max(0, int(size(self._group_size))) if callable(size) else 0

    def may_complete_group(self, row_ids: torch.Tensor | Sequence[int], columns: Sequence[str], task: str,
                           group_size: int) -> bool:
        """After a write to ``row_ids``: can a blocked lease of ``task`` for ``columns``, by a sampler that hands
        out whole groups of ``group_size`` rows, now succeed?

        A write changes only its own rows' readiness, so a lease that found no complete group before can find
        one now only in a group of a written row: False when no such group has ``group_size`` rows free for the
        task, alive and ready (version and partition filters are ignored: they only shrink the set). Once a
        stream ended (a remainder may be handed out) or whenever a group's rows are not found cheaply, this is
        :meth:`any_ready`. Deployments use it to wake a waiting group lease (GRPO's advantage and train stages)
        once per completed group instead of on every reward write.
        """
        t = self._tasks.get(task)
        if t is None or group_size <= 0 or self._ended_all or self._ended:
            return self.any_ready(row_ids, columns)
        s = self._slots(row_ids, missing="drop")
        if s.size == 0:
            return False
        # numpy throughout (called after every put a group lease waits on; see _slots)
        elig = self._eligible_mask(t.index, self._need_masks(columns))
        group = self._group_np
        fresh = s[elig[s]]
        if fresh.size == 0:
            return False
        groups = np.unique(group[fresh])
        groups = groups[groups >= 0]
        if groups.size == 0:
            return False  # ungrouped rows: a whole-group sampler never hands them out
        spans = [self._group_span.get(g) for g in groups.tolist()]
        if any(span is None for span in spans):
            return True
        known = self._row_id_np[: self._n]
        first = np.searchsorted(known, np.array([a for a, _ in spans], dtype=np.int64))
        lens = np.searchsorted(known, np.array([b for _, b in spans], dtype=np.int64), side="right") - first
        total = int(lens.sum())
        if total > 4 * group_size * groups.size + 1024:
            return True  # a group spread over many rows (re-used ids): not worth the scan
        seg = np.repeat(np.arange(groups.size), lens)
        idx = np.arange(total) - (np.cumsum(lens) - lens)[seg] + first[seg]
        hit = elig[idx] & (group[idx] == groups[seg])
        counts = np.bincount(seg[hit], minlength=groups.size)
        return bool((counts >= group_size).any())

    # ------------------------------------------------------------------ leasing

    def validate_request(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        lease_s: float | None = None,
        partition: str | None = None,
    ) -> None:
        """Raise the typed error a ``try_lease`` with these arguments would raise; mutates nothing."""
        self._scope(self._task(task), partition)
        if isinstance(columns, str):
            raise InvalidRequestError(f"columns must be a sequence of names, got the string {columns!r}")
        produced = self._produced()
        unknown = [c for c in columns if c not in produced]
        if unknown:
            raise UnknownColumnError(
                f"no registered task produces column(s) {unknown}; produced columns: {sorted(produced)}. "
                "Register the producing task with register_task(..., produces=[...]) or fix the column name"
            )
        if not isinstance(batch_size, int) or batch_size < 1 or batch_size > self._capacity:
            raise InvalidRequestError(
                f"batch_size must be between 1 and the store's capacity {self._capacity}, got {batch_size!r}"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise InvalidRequestError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if lease_s is not None and not lease_s > 0:
            raise InvalidRequestError(f"lease_s must be positive, got {lease_s}")

    def _sampler(self, sampler: str | Sampler | None) -> tuple[str, Sampler]:
        if isinstance(sampler, Sampler):
            return type(sampler).__name__, sampler
        name = sampler or self._default_sampler
        inst = self._samplers.get(name)
        if inst is None:
            from asyncflow_core.plugins import get_plugin_manager  # late: keeps the controller importable alone

            inst = get_plugin_manager().create("sampler", name, self._sampler_options.get(name))
            self._samplers[name] = inst
        return name, inst

    def _eligible(
        self, t: _Task, columns: Sequence[str], min_version: int | None, partition: str | None, limit: int = 0
    ) -> tuple[torch.Tensor, bool]:
        """Slots free for the task, ready for ``columns``, inside the filters, oldest first.

        With ``limit > 0`` the scan stops once the ``limit`` oldest are found
        (it goes chunk by chunk from the oldest row), so a store holding 10^6
        ready rows costs one chunk, not a full pass. Returns (slots, truncated).
        """
        slots, truncated = self._eligible_slots(t, columns, min_version, partition, limit)
        return torch.from_numpy(slots), truncated

    def _eligible_slots(
        self, t: _Task, columns: Sequence[str], min_version: int | None, partition: str | None, limit: int = 0
    ) -> tuple[np.ndarray, bool]:
        """:meth:`_eligible` as an int64 numpy array."""
        n = self._n
        empty = np.empty(0, dtype=np.int64)
        if partition is not None and partition not in self._partitions:
            return empty, False
        needs = self._need_masks(columns)
        pid = self._partitions[partition] if partition is not None else None
        # numpy, not torch: a torch op over more than 32,768 elements splits over the intra-op threads, and on a
        # host whose cores are busy that split waits (17 ms for one 65,536-row nonzero against 0.04 ms; see
        # store/indexing.py). numpy runs these scans on the calling thread.
        elig = self._eligible_mask(t.index, needs)
        minv, part = self._minv_np, self._partition_np
        chunk = n if limit <= 0 else max(_SCAN_CHUNK, limit)
        if n <= chunk:  # the whole table in one pass (the usual case): no chunk bookkeeping
            mask = elig[:n]  # the cache itself: the filters below must not write into it
            if min_version is not None:
                mask = mask & (minv[:n] >= min_version)
            if pid is not None:
                mask = mask & (part[:n] == pid)
            slots = mask.nonzero()[0].astype(np.int64, copy=False)  # flatnonzero without its wrapper
            if limit > 0 and slots.size > limit:
                return slots[:limit], True
            return slots, False
        found: list[np.ndarray] = []
        total = 0
        for lo in range(0, n, max(chunk, 1)):
            hi = min(n, lo + chunk)
            mask = elig[lo:hi]  # the cache itself: the filters below must not write into it
            if min_version is not None:
                mask = mask & (minv[lo:hi] >= min_version)
            if pid is not None:
                mask = mask & (part[lo:hi] == pid)
            idx = np.flatnonzero(mask)
            if lo:
                idx += lo
            found.append(idx)
            total += idx.size
            if limit > 0 and total >= limit:
                slots = np.concatenate(found) if len(found) > 1 else found[0]
                return slots[:limit].astype(np.int64, copy=False), total > limit or hi < n
        if not found:
            return empty, False
        slots = np.concatenate(found) if len(found) > 1 else found[0]
        return slots.astype(np.int64, copy=False), False

    def _eligible_now(self, task_index: int, needs: Sequence[tuple[int, int]], s: np.ndarray | slice
                      ) -> np.ndarray:
        """Bool per slot of ``s``: free for the task, alive, and ready for every (word, mask) of ``needs``."""
        ok = (self._state_np[task_index][s] == FREE) & self._alive_np[s]
        ready = self._ready_np
        for w, need in needs:
            ok &= (ready[s, w] & need) == need
        return ok

    def _eligible_mask(self, task_index: int, needs: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The kept-up-to-date eligibility of every slot (see ``_eligible_cache``); built on first use."""
        key = (task_index, needs)
        elig = self._eligible_cache.get(key)
        if elig is None:
            elig = np.zeros(self._alloc(), dtype=bool)
            elig[: self._n] = self._eligible_now(task_index, needs, slice(0, self._n))
            self._eligible_cache[key] = elig
        return elig

    def _refresh_eligible(self, s: np.ndarray, task_index: int | None = None,
                          touching: dict[int, int] | None = None) -> None:
        """Recompute the cached eligibility of slots ``s`` (for one task's entries, or all) after a change;
        ``touching`` (word -> bits): only the entries that need one of these ready bits."""
        if s.size == 0:
            return
        for (ti, needs), elig in self._eligible_cache.items():
            if task_index is not None and ti != task_index:
                continue
            if touching is not None and not any(touching.get(w, 0) & need for w, need in needs):
                continue
            elig[s] = self._eligible_now(ti, needs, s)

    def _candidates(self, s: np.ndarray) -> Candidates:
        if s.size == 0:  # most attempts of a waiting stage: nothing to gather
            empty = torch.empty(0, dtype=torch.int64)
            return Candidates(row_ids=empty, group_ids=empty, num_tokens=empty, min_version=empty,
                              group_ready=empty, group_size=self._group_size)
        # gathers and counting in numpy on the tables' views: single-threaded (see _eligible), no torch call
        g = self._group_np[s]
        groups = torch.from_numpy(g)
        n = g.size
        gmax = int(g.max()) if n else -1
        low = int(np.where(g >= 0, g, gmax).min()) if gmax >= 0 else 0  # the smallest group id among them
        if gmax < 0:
            group_ready = torch.from_numpy(np.zeros(n, dtype=np.int64))
        elif gmax - low < 4 * n + 4096:
            # ids in a narrow window (prompt indices of the rows live now, however far a run got): a bincount
            # over the window is O(n + window); bin 0 collects ungrouped rows
            shifted = np.where(g >= 0, g - (low - 1), 0)
            counts = np.bincount(shifted, minlength=gmax - low + 2)
            counts[0] = 0
            group_ready = torch.from_numpy(counts[shifted].astype(np.int64, copy=False))
        else:
            _, inverse, counts = np.unique(g, return_inverse=True, return_counts=True)
            group_ready = torch.from_numpy(np.where(g >= 0, counts[inverse.reshape(-1)], 0).astype(np.int64, copy=False))
        return Candidates(
            row_ids=torch.from_numpy(self._row_id_np[s]),
            group_ids=groups,
            num_tokens=torch.from_numpy(self._tokens_np[s]),
            min_version=torch.from_numpy(self._minv_np[s]),
            group_ready=group_ready,
            group_size=self._group_size,
        )

    def _blocking_count(self, t: _Task, columns: Sequence[str], min_version: int | None, partition: str | None) -> int:
        """Rows that are (or may become) leasable for the request: alive, not done, not ruled out by versions."""
        n = self._n
        if partition is not None and partition not in self._partitions:
            return 0
        mask = self._alive[:n] & (self._state[t.index][:n] != DONE)
        if partition is not None:
            mask &= self._partition[:n] == self._partitions[partition]
        if min_version is not None:
            ready = torch.ones(n, dtype=torch.bool)
            for w, need in self._need_masks(columns):
                ready &= (self._ready[:n, w] & need) == need
            # a row with no version yet may still receive one when a missing column is written
            mask &= (self._minv[:n] >= min_version) | ((self._minv[:n] < 0) & ~ready)
        return int(mask.sum())

    def stream_ended(self, partition: str | None = None) -> bool:
        """Whether no new rows can arrive (in ``partition``, or anywhere for ``None``)."""
        if self._ended_all:
            return True
        if not self._ended:  # no partition ended (every lease attempt asks)
            return False
        if partition is not None:
            return partition in self._ended
        return bool(self._partitions) and all(p in self._ended for p in self._partitions)

    def is_end_of_stream(
        self, task: str, columns: Sequence[str], min_version: int | None = None, partition: str | None = None
    ) -> bool:
        """The stream ended and no row can ever become ready and free for this request."""
        t = self._task(task)
        partition = self._scope(t, partition)
        return self.stream_ended(partition) and self._blocking_count(t, columns, min_version, partition) == 0

    def try_lease(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        sampler: str | Sampler | None = None,
        min_version: int | None = None,
        partition: str | None = None,
        partial: bool = False,
        lease_s: float | None = None,
        consumer: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        now: float = 0.0,
    ) -> BatchMeta | None:
        """Lease rows to ``task`` if the sampler can form a batch; ``None`` means "not yet, wait".

        Returns an empty meta with ``end_of_stream=True`` once the stream has
        ended and no row can become leasable for this request. After the end,
        a batch smaller than ``batch_size`` is handed out (as if ``partial``)
        when nothing else can arrive.

        Data parallel (``dp_size > 1``): the first rank to ask forms one global
        pick (the sampler is called once per rank on the same candidates, so
        a deterministic sampler splits one pick into disjoint parts) and every
        part is leased at once; rank ``r`` then claims part ``r`` of the
        oldest round it has not claimed yet. Unclaimed parts expire like any
        lease, so a rank that never comes back loses no rows.
        """
        columns = tuple(columns)
        lease_s = self._default_lease_s if lease_s is None else float(lease_s)
        self.validate_request(task, columns, batch_size, dp_rank, dp_size, lease_s, partition)
        t = self._tasks[task]
        partition = self._scope(t, partition)
        sampler_name, smp = self._sampler(sampler)
        if dp_size > 1:
            key = (task, columns, sampler_name, min_version, partition, batch_size, dp_size)
            claimed = self._claim_dp_part(key, dp_rank, consumer, lease_s, now)
            if claimed is not None:
                return claimed
        limit = max(self._max_candidates, 4 * batch_size) if self._max_candidates > 0 else 0
        slots, truncated = self._eligible_slots(t, columns, min_version, partition, limit)
        ended = self.stream_ended(partition)
        if slots.size == 0 and not partial and not ended:
            return None  # nothing to hand out and nothing to decide (most attempts of a waiting stage)
        if dp_size == 1 and getattr(smp, "takes_oldest", False) is True:
            # the sampler declares its pick is the oldest rows (Sampler.takes_oldest): no candidates to build
            return self._lease_oldest(task, t, columns, slots, ended, batch_size, min_version, partition, partial,
                                      consumer, lease_s, now)
        cands = self._candidates(slots)
        parts = self._sample(smp, cands, batch_size, partial, dp_size)
        if not any(p.numel() for p in parts) and ended:
            blocking = self._blocking_count(t, columns, min_version, partition)
            if blocking == 0:
                return self._eos_meta(task, columns)
            if blocking == len(cands) and not truncated and not partial:
                # nothing else can ever arrive: hand out the remainder
                parts = self._sample(smp, cands, batch_size, True, dp_size)
                if not any(p.numel() for p in parts):
                    return self._eos_meta(task, columns)  # the sampler can never use what is left
        if not (parts[0].numel() if dp_size == 1 else any(p.numel() for p in parts)):
            return None
        if dp_size == 1:
            return self._grant(task, columns, slots[parts[0].numpy()], consumer, lease_s, now, dp_rank=0)
        rnd = _DPRound()
        mine: BatchMeta | None = None
        for r, pos in enumerate(parts):
            if pos.numel() == 0:
                rnd.parts.append(None)
                continue
            meta = self._grant(
                task, columns, slots[pos.numpy()], consumer if r == dp_rank else None, lease_s, now,
                dp_rank=r, reserved=r != dp_rank,
            )
            if r == dp_rank:
                mine = meta
                rnd.parts.append(None)
            else:
                rnd.parts.append(meta.lease_id)
        if any(p is not None for p in rnd.parts):
            self._dp_rounds.setdefault(key, []).append(rnd)
        return mine

    def _lease_oldest(
        self, task: str, t: _Task, columns: tuple[str, ...], slots: np.ndarray, ended: bool, batch_size: int,
        min_version: int | None, partition: str | None, partial: bool, consumer: str | None, lease_s: float,
        now: float,
    ) -> BatchMeta | None:
        """The rest of :meth:`try_lease` (one rank) for a sampler that declares ``takes_oldest``: what the general
        path decides with that sampler's pick (the oldest ``min(len(slots), batch_size)`` of ``slots``, or none
        when fewer than ``batch_size`` without ``partial``), worked out from the count alone.

        The general path's conditions on ``partial`` and ``truncated`` for the remainder reduce to ``blocking ==
        n`` here: this pick is empty only with no slot (``partial``) or fewer than ``batch_size`` slots, and a
        truncated window holds at least ``4 * batch_size``."""
        n = slots.size
        k = n if n < batch_size else batch_size
        if k < batch_size and not partial:
            k = 0  # a full batch is needed and absent
        if k == 0:
            if not ended:
                return None
            blocking = self._blocking_count(t, columns, min_version, partition)
            if blocking == 0:
                return self._eos_meta(task, columns)
            if blocking != n:
                return None  # rows that may still become ready: wait for them
            k = n  # nothing else can ever arrive: hand out the remainder (n > 0, as blocking is)
        return self._grant(task, columns, slots[:k], consumer, lease_s, now, dp_rank=0)

    def _sample(
        self, smp: Sampler, cands: Candidates, batch_size: int, partial: bool, dp_size: int
    ) -> list[torch.Tensor]:
        if len(cands) == 0 and not partial:
            return [torch.empty(0, dtype=torch.int64)] * dp_size
        if dp_size == 1:
            parts = [_as_ids(smp.sample(cands, _request(batch_size, partial)))]
        else:
            parts = [_as_ids(smp.sample(cands, SampleRequest(batch_size, partial, r, dp_size))) for r in range(dp_size)]
        allpos = torch.cat(parts) if dp_size > 1 else parts[0]
        a = allpos.numpy()
        if a.size:
            # a sampler's pick is usually increasing (oldest first): then no sort and no min/max pass
            increasing = a.size < 2 or not count_nonzero(a[1:] <= a[:-1])
            lo, hi = (int(a[0]), int(a[-1])) if increasing else (int(a.min()), int(a.max()))
            if lo < 0 or hi >= cands.row_ids.numel():
                raise InvalidRequestError(f"sampler {type(smp).__name__} returned positions outside the candidates")
            if not increasing and has_repeats(a):
                raise InvalidRequestError(
                    f"sampler {type(smp).__name__} returned a row twice (or to two DP ranks); parts must be disjoint"
                )
            if allpos.numel() > batch_size:
                raise InvalidRequestError(
                    f"sampler {type(smp).__name__} returned {allpos.numel()} rows for batch_size {batch_size}"
                )
        return parts

    def _grant(
        self,
        task: str,
        columns: tuple[str, ...],
        s: np.ndarray,
        consumer: str | None,
        lease_s: float,
        now: float,
        *,
        dp_rank: int,
        reserved: bool = False,
    ) -> BatchMeta:
        t = self._tasks[task]
        lid = self._next_lease_id
        self._next_lease_id += 1
        self._fresh = None  # rows leased: the last add's rows may be among them (see mark_new_ready)
        self._state_np[t.index][s] = LEASED
        self._lease_of_np[t.index][s] = lid
        for (ti, _), elig in self._eligible_cache.items():
            if ti == t.index:
                elig[s] = False
        row_ids = torch.from_numpy(self._row_id_np[s])  # the candidates' ids at ``pos`` (a gather of fresh memory)
        deadline = now + lease_s
        lease = self._leases[lid] = _Lease(task, row_ids, columns, deadline, consumer, lease_s, reserved, s,
                                           self._slots_gen)
        self._push_deadline(deadline, lid)
        self._counters["leases_granted"] += 1
        return self._meta(lid, lease, s, dp_rank)

    def _meta(self, lid: int, lease: _Lease, s: np.ndarray, dp_rank: int) -> BatchMeta:
        rid = self._row_id_np
        # the meta's own tensors (fresh gathers; the lease keeps its row ids apart from the caller's); s are the
        # slots of exactly lease.row_ids (see _grant, _claim_dp_part)
        return BatchMeta._trusted(
            row_ids=torch.from_numpy(rid[s]),
            columns=lease.columns,
            task=lease.task,
            lease_id=lid,
            deadline=lease.deadline,
            group_ids=torch.from_numpy(self._group_np[s]),
            min_version=torch.from_numpy(self._minv_np[s]),
            max_version=torch.from_numpy(self._maxv_np[s]),
            num_tokens=torch.from_numpy(self._tokens_np[s]),
            extra={"consumer": lease.consumer, "dp_rank": dp_rank},
        )

    def _claim_dp_part(
        self, key: tuple, dp_rank: int, consumer: str | None, lease_s: float, now: float
    ) -> BatchMeta | None:
        rounds = self._dp_rounds.get(key)
        if not rounds:
            return None
        found = None
        for rnd in rounds:
            lid = rnd.parts[dp_rank] if dp_rank < len(rnd.parts) else None
            if lid is None:
                continue
            rnd.parts[dp_rank] = None
            if lid in self._leases:  # an expired reservation's rows already went back to free
                found = lid
                break
        self._dp_rounds[key] = [r for r in rounds if any(p is not None for p in r.parts)]
        if not self._dp_rounds[key]:
            del self._dp_rounds[key]
        if found is None:
            return None
        lease = self._leases[found]
        lease.consumer, lease.reserved = consumer, False
        lease.deadline, lease.lease_s = now + lease_s, lease_s
        self._push_deadline(lease.deadline, found)
        slots = self._slots(lease.row_ids, missing="drop")
        if slots.size != lease.row_ids.numel():  # some rows were cleared meanwhile
            lease.row_ids = torch.from_numpy(self._row_id_np[slots])
        lease.slots, lease.slots_gen = slots, self._slots_gen
        return self._meta(found, lease, slots, dp_rank)

    def _eos_meta(self, task: str, columns: tuple[str, ...]) -> BatchMeta:
        empty = torch.empty(0, dtype=torch.int64)
        return BatchMeta(
            row_ids=empty, columns=columns, task=task, group_ids=empty, min_version=empty, max_version=empty,
            num_tokens=empty, end_of_stream=True,
        )

    # ------------------------------------------------------------------ lease outcomes

    def _take_lease(self, lease_id: int, verb: str) -> _Lease:
        lease = self._leases.get(lease_id) if isinstance(lease_id, int) else None
        if lease is None:
            why = self._finished.get(lease_id) if isinstance(lease_id, int) else None
            if why is None:
                raise LeaseError(
                    f"cannot {verb} lease {lease_id!r}: no such lease was handed out. {verb.capitalize()} the meta "
                    "that get_meta() returned"
                )
            raise LeaseError(
                f"cannot {verb} lease {lease_id}: it was already {why}. Each lease is acknowledged or released "
                "once, before its deadline; an expired lease's rows may already be leased to someone else"
            )
        return lease

    def _finish(self, lease_id: int, why: str, new_state: int) -> int:
        return int(self._finish_slots(lease_id, why, new_state).size)

    def _finish_slots(self, lease_id: int, why: str, new_state: int) -> np.ndarray:
        """End a lease: its rows still held go to ``new_state`` for its task; returns their slots."""
        lease = self._leases.pop(lease_id)
        self._finished[lease_id] = why
        while len(self._finished) > _FINISHED_LEASES_KEPT:
            self._finished.popitem(last=False)
        t = self._tasks[lease.task]
        s = lease.slots if lease.slots_gen == self._slots_gen else self._slots(lease.row_ids, missing="drop")
        # only rows still held by this lease (cleared rows are gone, nothing else can hold them)
        lease_of = self._lease_of_np[t.index]
        held = lease_of[s] == lease_id
        if count_nonzero(held) != held.size:
            s = s[held]
        self._state_np[t.index][s] = new_state
        lease_of[s] = 0
        if new_state == FREE:
            self._refresh_eligible(s, t.index)  # leased or done rows were not eligible and stay so
        return s

    def ack(self, lease_id: int, now: float | None = None) -> int:
        """Mark the lease's rows done for its task; returns the number of rows acknowledged.

        ``LeaseError`` for a second ack, an unknown lease, or a lease whose
        deadline passed (``now >= deadline``; its rows go back to free).
        """
        return int(self._ack_slots(lease_id, now).size)

    def ack_and_collect(self, lease_id: int, now: float | None = None) -> tuple[int, torch.Tensor]:
        """:meth:`ack`, then :meth:`gc` of the rows it acknowledged; returns (rows acknowledged, dropped row ids
        for storage to free). What a deployment's ack does, in one call that finds the lease's rows once."""
        s = self._ack_slots(lease_id, now)
        return int(s.size), self._gc_slots(s)

    def _ack_slots(self, lease_id: int, now: float | None) -> np.ndarray:
        lease = self._take_lease(lease_id, "acknowledge")
        if now is not None and now >= lease.deadline:
            self._finish(lease_id, "expired", FREE)
            self._counters["leases_expired"] += 1
            raise LeaseError(
                f"cannot acknowledge lease {lease_id}: its deadline passed {now - lease.deadline:.3f}s ago and its "
                "rows went back to free. Ask for a longer lease_s, or acknowledge sooner"
            )
        s = self._finish_slots(lease_id, "acknowledged", DONE)
        self._counters["rows_done"] += int(s.size)
        return s

    def release(self, lease_id: int, now: float | None = None) -> int:
        """Return the lease's rows to free for its task; returns the number of rows freed."""
        self._take_lease(lease_id, "release")
        return self._finish(lease_id, "released", FREE)

    def renew(self, lease_id: int, lease_s: float | None = None, now: float | None = None) -> bool:
        """Extend a live lease: its deadline becomes ``now + lease_s``; returns whether the lease was live.

        ``lease_s`` defaults to the lease's own length (what ``try_lease`` was
        given); a new value also becomes the length later renewals use.
        ``now=None`` reads ``time.monotonic()``, the deployments' clock. False for a lease
        that was handed out and is no longer held (nothing changes): acknowledged,
        released, expired, freed because its consumer was declared dead, its
        rows cleared, or held before a ``load_state_dict`` (which frees every
        lease). Its rows may be someone else's by now: stop working on them,
        the ack would raise ``LeaseError``. A lease whose deadline passed
        (``now >= deadline``) and that :meth:`expire` has not reached yet is
        expired here (its rows go back to free) and answers False, as ``ack``
        does: a deadline is never moved once it has passed.

        ``InvalidRequestError`` for a ``lease_s`` that is not positive;
        ``LeaseError`` for an id no lease ever had (a meta from ``put``, or
        another store's lease): a bug in the caller, not an outcome.
        """
        if lease_s is not None and not (isinstance(lease_s, (int, float)) and 0 < lease_s < float("inf")):
            raise InvalidRequestError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        lease = self._leases.get(lease_id) if isinstance(lease_id, int) else None
        if lease is None:
            if isinstance(lease_id, int) and not isinstance(lease_id, bool) and 1 <= lease_id < self._next_lease_id:
                return False  # handed out once, finished since (its reason may have left _finished's window)
            raise LeaseError(
                f"cannot renew lease {lease_id!r}: no such lease was handed out. Renew the meta that get_meta() "
                "returned"
            )
        t = time.monotonic() if now is None else float(now)
        if t >= lease.deadline:
            self._finish(lease_id, "expired", FREE)
            self._counters["leases_expired"] += 1
            return False
        if lease_s is not None:
            lease.lease_s = float(lease_s)
        lease.deadline = t + lease.lease_s
        self._push_deadline(lease.deadline, lease_id)
        self._counters["leases_renewed"] += 1
        return True

    def expire(self, now: float) -> tuple[list[int], float | None]:
        """Free every lease whose deadline is ``<= now``; returns (expired lease ids, earliest remaining deadline)."""
        expired = []
        while (first := self.next_deadline()) is not None and first <= now:
            lid = heapq.heappop(self._deadlines)[1]
            # finished at once, so a second heap entry of the same deadline (a renewal that did not move it)
            # is stale when it reaches the top instead of expiring the lease twice
            self._finish(lid, "expired", FREE)
            expired.append(lid)
        self._counters["leases_expired"] += len(expired)
        return expired, first

    def next_deadline(self) -> float | None:
        """Earliest deadline of an outstanding lease (None if none): when waiters should wake to expire it."""
        heap = self._deadlines
        while heap:  # O(log leases) per call: every store call asks, and thousands of leases may be outstanding
            deadline, lid = heap[0]
            lease = self._leases.get(lid)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(heap)  # acknowledged, released, expired or re-dated since it was pushed
        return None

    def _push_deadline(self, deadline: float, lease_id: int) -> None:
        heapq.heappush(self._deadlines, (deadline, lease_id))
        if len(self._deadlines) > 4 * len(self._leases) + 1024:  # drop the stale entries that never reached the top
            self._deadlines = [(lease.deadline, lid) for lid, lease in self._leases.items()]
            heapq.heapify(self._deadlines)

    def declare_dead(self, consumer: str) -> int:
        """Free every lease held by ``consumer``; returns the number of rows freed."""
        mine = [lid for lid, lease in self._leases.items() if lease.consumer == consumer and consumer is not None]
        return sum(self._finish(lid, f"freed because consumer {consumer!r} was declared dead", FREE) for lid in mine)

    def lease_task(self, lease_id: int) -> str | None:
        """The task of an outstanding lease (None if not outstanding): :meth:`lease_info` without the copies."""
        lease = self._leases.get(lease_id)
        return None if lease is None else lease.task

    def lease_info(self, lease_id: int) -> dict[str, Any] | None:
        """Task, row ids, deadline and consumer of an outstanding lease (None if not outstanding)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        return {"task": lease.task, "row_ids": lease.row_ids.clone(), "deadline": lease.deadline,
                "consumer": lease.consumer, "columns": lease.columns}

    # ------------------------------------------------------------------ stream end, collection

    def end_stream(self, partition: str | None = None) -> None:
        """No more new rows in ``partition`` (or anywhere, for ``None``)."""
        if partition is None:
            self._ended_all = True
        else:
            self._partition_id(partition)
            self._ended.add(partition)

    def _drop(self, s: np.ndarray) -> torch.Tensor:
        ids = torch.from_numpy(self._row_id_np[s])
        self._alive_np[s] = False
        self._slots_gen += 1
        for elig in self._eligible_cache.values():
            elig[s] = False
        k = int(s.size)
        self._live -= k
        self._dead += k
        self._counters["rows_dropped"] += k
        if self._dead >= _MIN_COMPACT and self._dead * 2 > self._n:
            self._compact()
        return ids

    def gc(self, row_ids: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Drop rows done for every consumer task of their partition (only among ``row_ids`` if given);
        returns the dropped ids.

        A row's consumers are the consumer tasks scoped to its partition and
        the unscoped ones; a row no consumer covers is never collected (so
        with no consumer task registered nothing is). Rows dropped here are
        gone for tasks registered later.
        """
        if row_ids is None:
            return self._gc_slots(np.flatnonzero(self._alive_np[: self._n]))
        return self._gc_slots(self._slots(row_ids, missing="drop"))

    def _gc_slots(self, s: np.ndarray) -> torch.Tensor:
        """:meth:`gc` among live slots ``s``."""
        consumers = self._consumers_cache
        if consumers is None:  # asked on every ack; changes only when a task is registered
            consumers = self._consumers_cache = [t for t in self._tasks.values() if t.is_consumer]
        if not consumers:
            return torch.empty(0, dtype=torch.int64)
        # numpy: a few small-array ops per consumer task on every ack, without a torch call each (_slots)
        if len(consumers) == 1 and consumers[0].partition is None:  # the usual case: one consumer, every row
            return self._drop(s[self._state_np[consumers[0].index][s] == DONE])
        done = np.full(s.size, True)
        covered = np.zeros(s.size, dtype=bool)
        part = self._partition_np[s] if any(t.partition is not None for t in consumers) else None
        for t in consumers:
            if t.partition is None:
                applies = None  # every row
            elif t.partition in self._partitions and part is not None:
                applies = part == self._partitions[t.partition]
            else:
                continue
            is_done = self._state_np[t.index][s] == DONE
            if applies is None:
                done &= is_done
                covered[:] = True
            else:
                done &= is_done | ~applies
                covered |= applies
        return self._drop(s[done & covered])

    def drop_rows(self, row_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Drop the live rows among ``row_ids`` now, whatever their task states (e.g. rows a failed put
        allocated); leases left holding no row are forgotten. Returns the dropped ids."""
        dropped = self._drop(self._slots(row_ids, missing="drop"))
        self._forget_empty_leases()
        return dropped

    def clear(self, partition: str | None = None) -> torch.Tensor:
        """Drop every row (of ``partition``) and their leases; returns the dropped row ids."""
        n = self._n
        mask = self._alive[:n].clone()
        if partition is not None:
            if partition not in self._partitions:
                return torch.empty(0, dtype=torch.int64)
            mask &= self._partition[:n] == self._partitions[partition]
        dropped = self._drop(np.flatnonzero(mask.numpy()))
        self._dp_rounds.clear()
        self._forget_empty_leases()
        return dropped

    def _forget_empty_leases(self) -> None:
        for lid in list(self._leases):
            if self._slots(self._leases[lid].row_ids, missing="drop").size == 0:
                self._leases.pop(lid)
                self._finished[lid] = "cleared (its rows were dropped)"

    def _compact(self) -> None:
        n = self._n
        keep = np.flatnonzero(self._alive_np[:n])
        k = keep.size
        if k:  # with nothing live nothing moves: add_rows writes every field of a slot it reuses
            # the kept eligibility moves with its rows (it is a function of the row's fields)
            for arr in (self._row_id_np, self._alive_np, self._partition_np, self._group_np, self._tokens_np,
                        self._minv_np, self._maxv_np, self._ready_np, *self._state_np, *self._lease_of_np,
                        *self._eligible_cache.values()):
                arr[:k] = arr[:n][keep]
        self._alive_np[k:n] = False
        for elig in self._eligible_cache.values():
            elig[k:n] = False
        self._n = k
        self._dead = 0
        oldest = int(self._row_id_np[0]) if k else self._next_row_id
        self._group_span = {g: span for g, span in self._group_span.items() if span[1] >= oldest}
        self._slots_gen += 1

    # ------------------------------------------------------------------ checkpoint, stats

    def state_dict(self) -> dict[str, Any]:
        """Rows, readiness, versions and per-task progress; leases are not saved (they come back free)."""
        keep = self._alive[: self._n].nonzero().squeeze(1)
        states = {}
        for name, t in self._tasks.items():
            st = self._state[t.index][keep].clone()
            st[st == LEASED] = FREE
            states[name] = st
        return {
            "format": 1,
            "capacity": self._capacity,
            "group_size": self._group_size,
            "row_ids": self._row_id[keep].clone(),
            "partition": self._partition[keep].clone(),
            "group_ids": self._group[keep].clone(),
            "num_tokens": self._tokens[keep].clone(),
            "min_version": self._minv[keep].clone(),
            "max_version": self._maxv[keep].clone(),
            "ready": self._ready[keep].clone(),
            "columns": list(self._columns),
            "partitions": list(self._partitions),
            "tasks": [(name, list(t.consumes), list(t.produces), t.partition) for name, t in self._tasks.items()],
            "task_state": states,
            "ended": sorted(self._ended),
            "ended_all": self._ended_all,
            "next_row_id": self._next_row_id,
            "next_lease_id": self._next_lease_id,
            "counters": dict(self._counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (replacing everything); capacity stays this controller's."""
        if not isinstance(state, dict) or state.get("format") != 1:
            raise InvalidRequestError("not a controller state_dict (format 1); pass what Controller.state_dict() returned")
        row_ids = _as_ids(state["row_ids"])
        k = row_ids.numel()
        if k > self._capacity:
            raise InvalidRequestError(f"checkpoint holds {k} live rows, more than this store's capacity {self._capacity}")
        self._reset()
        for p in state["partitions"]:  # first: partition ids must come back as saved
            self._partition_id(p)
        for c in state["columns"]:  # before the tasks: column bits must come back as saved
            self._column_bit(c)
        for name, consumes, produces, *scope in state["tasks"]:  # checkpoints before partition scopes have 3
            self.register_task(name, consumes, produces, scope[0] if scope else None)
        self._ensure_slots(k)
        self._row_id[:k] = row_ids
        self._alive[:k] = True
        self._partition[:k] = state["partition"]
        self._group[:k] = state["group_ids"]
        self._tokens[:k] = state["num_tokens"]
        self._minv[:k] = state["min_version"]
        self._maxv[:k] = state["max_version"]
        ready = state["ready"]
        self._ready[:k, : ready.shape[1]] = ready
        for name, st in state["task_state"].items():
            self._state[self._tasks[name].index][:k] = st
        self._n = self._live = k
        if k:
            self._note_group_spans(self._row_id[:k], self._group[:k])
        self._eligible_cache.clear()
        self._slots_gen += 1
        self._ended = set(state["ended"])
        self._ended_all = bool(state["ended_all"])
        self._next_row_id = int(state["next_row_id"])
        self._next_lease_id = int(state["next_lease_id"])
        self._counters.update(state["counters"])

    def stats(self) -> dict[str, int]:
        """Counters: rows_live, rows_leased ((row, task) pairs held), rows_done (pairs acknowledged, cumulative),
        rows_dropped, rows_put, leases_active, leases_granted, leases_expired, tasks, columns."""
        n = self._n
        leased = sum(int(((s[:n] == LEASED) & self._alive[:n]).sum()) for s in self._state)
        return {
            "rows_live": self._live,
            "rows_leased": leased,
            **self._counters,
            "leases_active": len(self._leases),
            "tasks": len(self._tasks),
            "columns": len(self._columns),
            "capacity": self._capacity,
        }
