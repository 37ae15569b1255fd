"""The store's data plane: column values of rows, dense and ragged, written and read by row id.

:class:`StorageUnit` knows nothing about readiness or leases (that is the
controller's job); it stores what it is given and returns it in the order
asked. Deployments put one or more units next to a controller.

Layout, chosen so a write costs O(values written) and a read is a handful of
vectorised gathers whatever the write pattern was:

- a row table addressed by ``row_id - base`` (row ids are dense and increase,
  so a direct-address table beats hashing; ``base`` moves forward as old rows
  are freed, and the table is reset whenever it empties). The per-row tables
  are numpy arrays: always on the CPU, indexed with no torch dispatch, no
  ``Tensor.numpy()`` per access and no release of the GIL (``store/indexing.py``);
- a dense column is one tensor ``[table, *trailing]``: row ``i``'s value sits
  at its table position;
- a ragged column is a packed arena of values plus per-row ``(start, length)``
  into it: writes append, frees and overwrites leave garbage that is
  compacted (one vectorised gather) once it outweighs the live values.
  Ragged values are never padded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncflow_core.store.controller import has_repeats
from asyncflow_core.store.errors import ColumnTypeError, InvalidRequestError, UnknownColumnError, UnknownRowError
from asyncflow_core.store.indexing import assign, count_nonzero, take
from asyncflow_core.types import Batch, Column, RaggedTensor

_MIN_TABLE = 1024
_MIN_ARENA = 4096


@dataclass
class ColumnSchema:
    """What the first write of a column fixed: ragged or dense, dtype, and the per-element trailing shape."""

    ragged: bool
    dtype: torch.dtype
    trailing: tuple[int, ...]

    def describe(self) -> str:
        kind = "ragged" if self.ragged else "dense"
        return f"{kind} {str(self.dtype).removeprefix('torch.')} with trailing shape {self.trailing}"


class _Dense:
    def __init__(self, schema: ColumnSchema, alloc: int, device: torch.device) -> None:
        self.data = torch.zeros((alloc, *schema.trailing), dtype=schema.dtype, device=device)
        self.present = np.zeros(alloc, dtype=bool)


class _Ragged:
    def __init__(self, schema: ColumnSchema, alloc: int, device: torch.device) -> None:
        self.set_values(torch.zeros((_MIN_ARENA, *schema.trailing), dtype=schema.dtype, device=device))
        self.used = 0
        self.garbage = 0
        self.start = np.zeros(alloc, dtype=np.int64)
        self.length = np.zeros(alloc, dtype=np.int64)  #: 0 wherever ``present`` is False
        self.present = np.zeros(alloc, dtype=bool)

    def set_values(self, values: torch.Tensor) -> None:
        """Make ``values`` the arena; what uses its storage now is the arena's own share (see :meth:`in_use`)."""
        self.values = values
        self.zero_width = _zero_width(values)  #: lengths-only values (see :func:`_zero_width`)
        self.viewed = False  #: a read handed out a view of this arena
        #: the arena as numpy (None unless a CPU dtype numpy has): writes and gathers slice and copy through it,
        #: a tenth of the cost of a torch slice and a single-threaded copy (see _NUMPY_DTYPES)
        self.np_values = values.numpy() if _numpy_viewable(values) else None
        # the storage object is kept (its reference is part of the arena's own share), so a check is one call
        # on its handle instead of a new storage object per check (two per ack)
        self._storage = values.untyped_storage()
        self._cdata = self._storage._cdata
        self._own_users = None if _USE_COUNT is None else int(_USE_COUNT(self._cdata))

    def in_use(self) -> bool:
        """Whether a view a read handed out may still see this arena (so its memory must not be rewritten)."""
        if not self.viewed:
            return False
        if self._own_users is None:
            return True
        if int(_USE_COUNT(self._cdata)) > self._own_users:
            return True
        self.viewed = False  # every view handed out is gone; a later read that hands one out sets it again
        return False


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
  #: how many tensors (views included) and storage objects use a storage; None when torch cannot say


def check_column_schema(name: str, want: ColumnSchema | None, got: ColumnSchema) -> None:
    """The one column-schema check every storage shares: ``ColumnTypeError`` unless a write of ``got`` matches
    the schema ``want`` that the column's first write fixed (``None``: not written yet, anything goes)."""
    if want is not None and want != got:
        raise ColumnTypeError(
            f"column {name!r} was first written as {want.describe()}, this write is {got.describe()}; "
            f"convert it (e.g. .to({want.dtype})) or use another column name"
        )


def _schema_of(column: Column) -> ColumnSchema:
    if isinstance(column, RaggedTensor):
        return ColumnSchema(True, column.values.dtype, tuple(column.values.shape[1:]))
    if not isinstance(column, torch.Tensor):
        raise ColumnTypeError(
            f"a column must be a torch.Tensor (dense) or a RaggedTensor, got {type(column).__name__}; "
            "wrap lists with torch.tensor(...) or RaggedTensor.from_sequences(...)"
        )
    if column.dim() == 0:
        raise ColumnTypeError("a dense column needs a leading row dimension; got a 0-d tensor (use tensor.reshape(1))")
    return ColumnSchema(False, column.dtype, tuple(column.shape[1:]))


def _rows(column: Column) -> int:
    return len(column) if isinstance(column, RaggedTensor) else int(column.shape[0])


class StorageUnit:
    """Holds column values for rows; reads any row subset back as a :class:`Batch`.

    Public methods: ``validate(num_rows, columns)``, ``write(row_ids, columns)``,
    ``read(row_ids, columns) -> Batch``, ``has(row_ids, column) -> Tensor``,
    ``lengths(row_ids, column) -> Tensor``, ``free(row_ids)``, ``clear()``,
    ``schema``, ``nbytes``, ``allocated_nbytes``, ``num_rows``,
    ``state_dict()`` / ``load_state_dict(state)``.

    A column's schema (ragged or dense, dtype, trailing shape) is fixed by its
    first write; later writes must match it (``ColumnTypeError``), values are
    never silently cast. Writes are validated completely before anything is
    stored.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._schema: dict[str, ColumnSchema] = {}
        self._reset_rows()

    def _reset_rows(self) -> None:
        self._base = 0
        self._alloc = _MIN_TABLE
        self._known = np.zeros(self._alloc, dtype=bool)
        self._num_known = 0
        self._cols: dict[str, _Dense | _Ragged] = {
            name: self._new_col(schema) for name, schema in self._schema.items()
        }

    def _new_col(self, schema: ColumnSchema) -> _Dense | _Ragged:
        return (_Ragged if schema.ragged else _Dense)(schema, self._alloc, self.device)

    # ------------------------------------------------------------------ schema, validation

    @property
    def schema(self) -> dict[str, ColumnSchema]:
        """Column name -> schema fixed by its first write."""
        return dict(self._schema)

    @property
    def num_rows(self) -> int:
        """Rows holding at least one value."""
        return self._num_known

    def validate(self, num_rows: int, columns: Mapping[str, Column]) -> None:
        """Raise ``ColumnTypeError`` unless every column holds ``num_rows`` rows and matches its schema."""
        schema = self._schema
        for name, col in columns.items():
            if type(col) is RaggedTensor:  # the usual write: a ragged column of a known schema, checked inline
                want = schema.get(name)  # a known name is a valid one (it was checked when first written)
                v = col.values
                if (want is not None and want.ragged and want.dtype == v.dtype and want.trailing == v.shape[1:]
                        and v.dim() and col.offsets.numel() - 1 == num_rows):
                    continue
            if not isinstance(name, str) or not name:
                raise ColumnTypeError(f"column names must be non-empty strings, got {name!r}")
            try:
                got = _schema_of(col)
            except ColumnTypeError as exc:
                raise ColumnTypeError(f"column {name!r}: {exc}") from None
            if _rows(col) != num_rows:
                raise ColumnTypeError(
                    f"column {name!r} holds {_rows(col)} rows but {num_rows} rows are being written; "
                    "give every column one value (or sequence) per row"
                )
            want = schema.get(name)
            if want is not None and want != got and not self._reshapes(name, want, got, col):
                check_column_schema(name, want, got)
            if got.ragged and col.values.dim() == 0:  # type: ignore[union-attr]
                raise ColumnTypeError(f"ragged column {name!r} needs values with a token axis")

    def _reshapes(self, name: str, want: ColumnSchema, got: ColumnSchema, col: Column) -> bool:
        """A ragged write that differs from the schema only in trailing shape, allowed when it carries no values
        (e.g. placeholders for failed rows beside zero-width, lengths-only sequences) or when the column holds
        no values yet (its first rows were such placeholders): the write then fixes the trailing shape."""
        if not (want.ragged and got.ragged and want.dtype == got.dtype):
            return False
        if col.numel_packed == 0:  # type: ignore[union-attr]
            return True
        store = self._cols.get(name)
        return isinstance(store, _Ragged) and store.used == store.garbage

    # ------------------------------------------------------------------ row table

    def _relayout(self, new_base: int, new_alloc: int) -> None:
        """Move every per-row array to a table starting at ``new_base`` with ``new_alloc`` slots."""
        shift = self._base - new_base
        old = np.arange(self._alloc, dtype=np.int64)
        src = np.flatnonzero((old + shift >= 0) & (old + shift < new_alloc))
        dst = src + shift

        def move(t: np.ndarray) -> np.ndarray:
            out = np.zeros(new_alloc, dtype=t.dtype)
            out[dst] = t[src]
            return out

        def move_data(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((new_alloc, *t.shape[1:]), dtype=t.dtype, device=t.device)
            assign(out, torch.from_numpy(dst).to(t.device), take(t, torch.from_numpy(src).to(t.device)))
            return out

        self._known = move(self._known)
        for col in self._cols.values():
            col.present = move(col.present)
            if isinstance(col, _Dense):
                col.data = move_data(col.data)
            else:
                col.start = move(col.start)
                col.length = move(col.length)
        self._base, self._alloc = new_base, new_alloc

    def _ensure(self, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Table positions of ``ids`` (all in ``[lo, hi)``), growing or re-anchoring the table so they fit."""
        if self._num_known == 0:
            if hi - lo > self._alloc:
                self._alloc = max(2 * self._alloc, hi - lo)
                self._known = np.zeros(self._alloc, dtype=bool)
                self._cols = {name: self._new_col(s) for name, s in self._schema.items()}
            self._base = lo  # empty table: re-anchor for free
        new_lo = min(self._base, lo)
        new_hi = max(self._base + self._alloc, hi)
        if new_lo != self._base or new_hi - new_lo > self._alloc:
            self._relayout(new_lo, max(2 * self._alloc, new_hi - new_lo))
        return ids - self._base

    def _inside(self, pos: np.ndarray) -> np.ndarray | None:
        """``pos`` limited to the table: the positions that fall inside it, or None when all of them do."""
        if pos.size == 0 or (int(pos.min()) >= 0 and int(pos.max()) < self._alloc):
            return None
        return np.flatnonzero((pos >= 0) & (pos < self._alloc))

    def _run(self, ids: np.ndarray) -> slice | None:
        """The table slice of ``ids`` when they are consecutive and increasing (more than one), inside the table
        and all held; else None."""
        n = ids.size
        if n < 2:
            return None
        i0 = int(ids[0])
        p0 = i0 - self._base
        p1 = p0 + n
        if int(ids[-1]) - i0 + 1 != n or p0 < 0 or p1 > self._alloc or count_nonzero(ids[1:] <= ids[:-1]):
            return None
        return slice(p0, p1) if count_nonzero(self._known[p0:p1]) == n else None

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        pos = ids - self._base
        inside = self._inside(pos)
        if inside is None:
            ok = self._known[pos]
        else:
            ok = np.zeros(pos.size, dtype=bool)
            ok[inside] = self._known[pos[inside]]
        if not bool(ok.all()):
            bad = ids[~ok][:8].tolist()
            raise UnknownRowError(f"rows {bad} hold no data in this storage unit (never written, or freed); "
                                  "use the row_ids of a meta that put() or get_meta() returned")
        return pos

    # ------------------------------------------------------------------ write, read

    def write(self, row_ids: torch.Tensor | Sequence[int], columns: Mapping[str, Column], *,
              validated: bool = False) -> None:
        """Store ``columns`` for ``row_ids`` (row ``i`` of each column belongs to ``row_ids[i]``), replacing old values.

        ``validated=True``: the caller ran :meth:`validate` on these columns already (with nothing written
        since), so it is not repeated."""
        ids = _ids(row_ids)
        if not validated:
            self.validate(ids.size, columns)
        if ids.size == 0:
            return
        increasing = ids.size < 2 or not count_nonzero(ids[1:] <= ids[:-1])  # usual: no sort, no min/max pass
        lo, hi = (int(ids[0]), int(ids[-1]) + 1) if increasing else (int(ids.min()), int(ids.max()) + 1)
        if lo < 0:
            raise InvalidRequestError("row ids must be non-negative")
        if not increasing and has_repeats(ids):
            raise InvalidRequestError("row ids repeat in one write; write each row once per call")
        # everything validated: from here on nothing raises on bad input
        for name, col in columns.items():
            if name not in self._schema:
                self._schema[name] = _schema_of(col)
                self._cols[name] = self._new_col(self._schema[name])
            elif (isinstance(col, RaggedTensor) and col.values.shape[0]
                  and self._schema[name].trailing != col.values.shape[1:]):  # dtypes match (validated)
                self._schema[name] = _schema_of(col)  # validated: the column held no values (see _reshapes)
                store = self._cols[name]
                store.set_values(store.values.new_zeros((store.values.shape[0], *col.values.shape[1:])))  # type: ignore[union-attr]
        pos = self._ensure(ids, lo, hi)
        # consecutive ids (every put of new rows): the table positions are a slice, so each per-row table is
        # read and written through a view instead of a gather and a scatter
        at: np.ndarray | slice = slice(lo - self._base, hi - self._base) if increasing and hi - lo == ids.size else pos
        known = self._known
        self._num_known += ids.size - int(count_nonzero(known[at]))
        known[at] = True
        for name, col in columns.items():
            store = self._cols[name]
            if isinstance(store, _Dense):
                assign(store.data, torch.from_numpy(pos).to(self.device), col.to(self.device))  # type: ignore[union-attr]
            else:
                self._append_ragged(store, at, col)  # type: ignore[arg-type]
            store.present[at] = True

    def _append_ragged(self, store: _Ragged, pos: np.ndarray | slice, col: RaggedTensor) -> None:
        old = store.present[pos]
        if count_nonzero(old):  # rows written before: their segments are garbage now, so compaction drops them
            was = (pos if isinstance(pos, np.ndarray) else np.arange(pos.start, pos.stop))[old]
            store.garbage += int(store.length[was].sum())
            store.present[was] = False
            store.length[was] = 0
        total = col.numel_packed
        if store.used and store.used == store.garbage and not store.in_use():
            # nothing live, and no reader sees the arena any more: start it over on its warm pages (a reader
            # that still held a view when the last row was freed kept this from happening then)
            store.used = store.garbage = 0
        if store.used + total > store.values.shape[0]:
            self._compact_arena(store, extra=total)
        if total and not store.zero_width:  # lengths-only values: only the offsets are kept
            v = col.values
            arena = store.np_values
            if arena is not None and v.is_cpu and v.dtype == store.values.dtype and not v.requires_grad:
                np.copyto(arena[store.used : store.used + total], v.numpy())  # one single-threaded memcpy
            else:
                _copy_into(store.values[store.used : store.used + total],
                           v if v.device == self.device else v.to(self.device))
        offsets = _cpu_numpy(col.offsets)
        if isinstance(pos, slice):  # straight into the tables' views, no temporaries
            np.add(offsets[:-1], store.used, out=store.start[pos])
            np.subtract(offsets[1:], offsets[:-1], out=store.length[pos])
        else:
            store.start[pos] = store.used + offsets[:-1]
            store.length[pos] = offsets[1:] - offsets[:-1]
        store.used += total

    def _compact_arena(self, store: _Ragged, extra: int = 0) -> None:
        """Pack live segments to the front (dropping garbage), growing the arena so ``extra`` more fits."""
        live = store.used - store.garbage
        cap = store.values.shape[0]
        new_cap = cap
        while new_cap < live + extra or (new_cap < 2 * (live + extra)):
            new_cap *= 2
        pos = np.flatnonzero(store.present)
        # keep arena order (ordered by start), so contiguous writes stay contiguous
        pos = pos[np.argsort(store.start[pos], kind="stable")]
        starts, lens = store.start[pos], store.length[pos]
        new_starts = np.cumsum(lens) - lens
        old_values = store.values
        if new_cap == cap and _numpy_viewable(old_values) and not store.in_use():
            # the same size: pack in place, so the arena's pages (touched already) are reused; a fresh arena
            # would page-fault on every write after each compaction (a copy into fresh pages ran at a third of
            # memcpy here). Not while a reader's view may still see the arena: it gets a fresh one instead
            _pack_in_place(old_values, starts, lens)
        else:
            # uninitialised: every slot below ``live`` is written next, and nothing reads past ``used``
            values = torch.empty((new_cap, *old_values.shape[1:]), dtype=old_values.dtype, device=self.device)
            if not _zero_width(values):  # zero-width values have nothing to move
                _pack_segments(old_values, values, starts, lens)
            store.set_values(values)
        store.start[pos] = new_starts
        store.used, store.garbage = live, 0

    def read(self, row_ids: torch.Tensor | Sequence[int], columns: Sequence[str], *, views: bool = False) -> Batch:
        """Columns of ``row_ids`` as a :class:`Batch` in the order given, ``row_ids`` set.

        Values are copies, except with ``views=True``: a ragged column whose rows lie back to back in the arena
        (rows read in the order one put wrote them, the common case) is then a view of it. The unit never
        writes arena memory that a live view may see (a compaction or a restart of the arena while one is
        referenced moves to a fresh arena), so such a view keeps its values as long as it is referenced;
        it must be treated as read-only.
        """
        if isinstance(row_ids, torch.Tensor) and row_ids.dtype == torch.int64 and row_ids.dim() == 1:
            ids_t = row_ids  # what as_tensor and reshape would give (the same memory), without their dispatch
        else:
            ids_t = torch.as_tensor(row_ids, dtype=torch.int64).reshape(-1)
        ids = _cpu_numpy(ids_t)
        out: dict[str, Column] = {}
        cols = self._cols
        for name in columns:
            if name not in cols:
                raise UnknownColumnError(
                    f"column {name!r} was never written; written columns: {sorted(cols)}"
                )
        at = self._run(ids)
        # consecutive rows, all held (a lease of what one put wrote, the usual read): the per-row tables are
        # read through a slice (views), not gathered
        pos = self._positions(ids) if at is None and ids.size else ids - self._base
        if at is None:
            at = pos
        for name in columns:
            store = cols[name]
            present = store.present[at]
            if count_nonzero(present) != present.size:
                bad = ids[~present][:8].tolist()
                raise UnknownColumnError(
                    f"rows {bad} have no value for column {name!r} yet; lease rows with get_meta(columns=[...]) "
                    "so only rows whose columns are ready are read"
                )
            if isinstance(store, _Dense):
                out[name] = take(store.data, torch.from_numpy(pos).to(self.device))
            else:
                out[name] = _gather_ragged(store, at, self.device, views=views)
        # every column was built here for exactly these rows: no re-check of what was just built
        return Batch._trusted(out, ids_t, int(ids.size))

    def has(self, row_ids: torch.Tensor | Sequence[int], column: str) -> torch.Tensor:
        """Bool per row: does it hold a value for ``column``?"""
        ids = _ids(row_ids)
        store = self._cols.get(column)
        if store is None:
            return torch.zeros(ids.size, dtype=torch.bool)
        return torch.from_numpy(self._per_row(store.present, ids - self._base))

    def lengths(self, row_ids: torch.Tensor | Sequence[int], column: str) -> torch.Tensor:
        """Per-row sequence length of a ragged ``column`` (0 where absent, or for dense columns)."""
        ids = _ids(row_ids)
        store = self._cols.get(column)
        if not isinstance(store, _Ragged):
            return torch.zeros(ids.size, dtype=torch.int64)
        return torch.from_numpy(self._per_row(store.length, ids - self._base))  # 0 where absent (see _Ragged)

    def _per_row(self, table: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """``table[pos]``, with 0 (False) for positions outside the table; always a fresh array."""
        inside = self._inside(pos)
        if inside is None:
            return table[pos]
        out = np.zeros(pos.size, dtype=table.dtype)
        out[inside] = table[pos[inside]]
        return out

    # ------------------------------------------------------------------ freeing

    def free(self, row_ids: torch.Tensor | Sequence[int]) -> None:
        """Forget ``row_ids`` (unknown ids are ignored) and reclaim their space."""
        ids = _ids(row_ids)
        if ids.size == 0:
            return
        known = self._known
        pos: np.ndarray | slice | None = self._run(ids)  # consecutive and all held: slices of the tables
        if pos is not None:
            count = ids.size
        else:
            pos = ids - self._base
            inside = self._inside(pos)
            if inside is not None:
                pos = pos[inside]
            held = known[pos]
            if not held.all():
                pos = pos[held]
            count = pos.size
            if count == 0:
                return
        known[pos] = False
        self._num_known -= count
        for store in self._cols.values():
            if isinstance(store, _Ragged):
                store.garbage += int(_SUM(store.length[pos]))  # 0 where absent (see _Ragged)
                store.length[pos] = 0
                # reclaim garbage now unless a reader may still see the arena (a write that needs the room
                # compacts then, into a fresh arena if it is still seen)
                if store.garbage > _MIN_ARENA and 2 * store.garbage > store.used and not store.in_use():
                    store.present[pos] = False
                    self._compact_arena(store)
            store.present[pos] = False
        if self._num_known == 0:
            for store in self._cols.values():  # an empty unit starts its arenas over (see _append_ragged)
                if isinstance(store, _Ragged) and not store.in_use():
                    store.used = store.garbage = 0
        else:
            first = int(np.argmax(known))  # the first live slot
            if first > _MIN_TABLE and 2 * first > self._alloc:
                self._relayout(self._base + first, self._alloc)

    def clear(self) -> None:
        """Forget every row (schemas stay)."""
        self._reset_rows()

    # ------------------------------------------------------------------ size, checkpoint

    @property
    def nbytes(self) -> int:
        """Bytes of stored values (live rows only; excludes slack and garbage)."""
        total = 0
        for name, store in self._cols.items():
            s = self._schema[name]
            elem = torch.empty((), dtype=s.dtype).element_size() * int(torch.Size(s.trailing).numel())
            if isinstance(store, _Dense):
                total += int(np.count_nonzero(store.present)) * elem
            else:
                total += (store.used - store.garbage) * elem
        return total

    @property
    def allocated_nbytes(self) -> int:
        """Bytes held by buffers, slack and garbage included."""
        total = 0
        for store in self._cols.values():
            buf = store.data if isinstance(store, _Dense) else store.values
            total += buf.element_size() * buf.numel()
        return total

    def state_dict(self) -> dict[str, Any]:
        """Every stored value, by column, with the rows that hold it."""
        cols: dict[str, Any] = {}
        for name, store in self._cols.items():
            pos = np.flatnonzero(store.present)
            ids = torch.from_numpy(pos + self._base)
            if isinstance(store, _Dense):
                data: Column = store.data[torch.from_numpy(pos).to(self.device)].cpu()
            else:
                data = _gather_ragged(store, pos, self.device).to("cpu")
            s = self._schema[name]
            cols[name] = {"ragged": s.ragged, "dtype": str(s.dtype).removeprefix("torch."), "trailing": s.trailing,
                          "row_ids": ids, "data": data}
        return {"format": 1, "columns": cols}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace everything with :meth:`state_dict` output."""
        if not isinstance(state, dict) or state.get("format") != 1:
            raise InvalidRequestError("not a storage state_dict (format 1); pass what StorageUnit.state_dict() returned")
        self._schema = {}
        for name, c in state["columns"].items():
            self._schema[name] = ColumnSchema(bool(c["ragged"]), getattr(torch, c["dtype"]), tuple(c["trailing"]))
        self._reset_rows()
        for name, c in state["columns"].items():
            if c["row_ids"].numel():
                self.write(c["row_ids"], {name: c["data"]})


#: mean row length (elements) above which a ragged gather copies whole slices instead of indexing each element
_SLICE_GATHER_MIN_MEAN = 32


def _pack_segments(src: torch.Tensor, dst: torch.Tensor, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Copy segments ``src[starts[i] : starts[i] + lengths[i]]`` (sorted by start) back to back to the front of ``dst``.

    Touching segments are merged into runs first (rows written by one put lie
    together), so the copy is one slice per run at memory speed; short
    segments go through one vectorised per-element gather instead.
    """
    total = int(lengths.sum())
    if total == 0:
        return
    if total < _SLICE_GATHER_MIN_MEAN * lengths.size:
        dst[:total] = take(src, torch.from_numpy(_segment_index(starts, lengths)).to(src.device))
        return
    ends = starts + lengths
    head = np.ones(starts.size, dtype=bool)
    head[1:] = starts[1:] != ends[:-1]
    first = np.flatnonzero(head)
    last = np.append(first[1:] - 1, starts.size - 1)
    out = 0
    for a, b in zip(starts[first].tolist(), ends[last].tolist(), strict=True):
        _copy_into(dst[out : out + b - a], src[a:b])
        out += b - a


#: dtypes numpy can view without a copy; a CPU copy of one of them at least this many elements long goes through
#: numpy (one single-threaded memcpy) instead of torch's copy kernel, which splits a copy that long over its
#: intra-op threads: on a host whose cores are busy (engines, trainer ranks) that split waits for a descheduled
#: thread, measured at 9 ms for a 0.7 MB copy on 2 busy cores against 0.2 ms on one thread (docs/performance.md)
_NUMPY_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                           torch.float64, torch.float32, torch.float16})
_NUMPY_MIN_ELEMENTS = 1 << 15  #: torch's intra-op grain size: shorter copies run on one thread anyway


def _numpy_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    # the length first: most copies of a small put or read end the check there
    return (dst.numel() >= _NUMPY_MIN_ELEMENTS and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.dtype == src.dtype and dst.dtype in _NUMPY_DTYPES and dst.shape == src.shape
            and not dst.requires_grad and not src.requires_grad)


def _numpy_viewable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad and not _zero_width(t)


def _pack_in_place(values: torch.Tensor, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Move segments ``values[starts[i] : starts[i] + lengths[i]]`` (sorted by start) back to back to the front of
    ``values`` itself. Segment i lands at or below its start and ends at or below segment i + 1's start, so no
    move overwrites a segment not yet moved; numpy's copy handles the overlap within one move."""
    arr = values.numpy()
    out = 0
    for a, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        if n and out != a:
            np.copyto(arr[out : out + n], arr[a : a + n])
        out += n


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (same shape), as one memcpy on CPU when that is what it is (see :data:`_NUMPY_DTYPES`)."""
    if _numpy_copyable(dst, src):
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in fresh torch memory, copied as :func:`_copy_into` does."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    _copy_into(out, t)
    return out


def _zero_width(values: torch.Tensor) -> bool:
    """Values whose trailing shape holds no elements (e.g. ``[tokens, 0]``): a lengths-only ragged column."""
    return values.dim() > 1 and 0 in values.shape[1:]


def _runs(starts: np.ndarray, lens: np.ndarray) -> tuple[list[int], list[int]]:
    """Segments ``starts[i] .. starts[i] + lens[i]`` (in read order) merged where one ends where the next starts:
    (run starts, run ends) as lists. Rows one put wrote come out as one run."""
    ends = starts + lens
    head = np.empty(starts.size, dtype=bool)
    head[0] = True
    np.not_equal(starts[1:], ends[:-1], out=head[1:])
    first = head.nonzero()[0]
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = starts.size - 1
    return starts[first].tolist(), ends[last].tolist()


def _segment_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Positions ``starts[i] .. starts[i] + lens[i]`` for every segment, concatenated (vectorised).

    In numpy (the tables are CPU int64): torch's ``repeat_interleave`` path took 0.4 ms a call here, numpy 20 µs.
    """
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    seg = np.repeat(np.arange(lens.size), lens)
    offsets = np.cumsum(lens) - lens
    return starts[seg] + (np.arange(total, dtype=np.int64) - offsets[seg])


def _ids(row_ids: torch.Tensor | Sequence[int]) -> np.ndarray:
    """Row ids as a 1-D int64 numpy array (shares a CPU int64 tensor's memory)."""
    if isinstance(row_ids, torch.Tensor) and row_ids.dtype == torch.int64 and row_ids.dim() == 1 and row_ids.is_cpu:
        return row_ids.numpy()
    return _cpu_numpy(torch.as_tensor(row_ids, dtype=torch.int64).reshape(-1))


def _cpu_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (a copy from another device)."""
    return t.numpy() if t.is_cpu else t.cpu().numpy()


_ACCUMULATE = np.add.accumulate
_SUM = np.add.reduce  #: ndarray.sum without its Python wrapper


def _gather_ragged(store: _Ragged, pos: np.ndarray | slice, device: torch.device, views: bool = False
                   ) -> RaggedTensor:
    st, ln = store.start[pos], store.length[pos]
    offs = np.empty(ln.size + 1, dtype=np.int64)
    offs[0] = 0
    _ACCUMULATE(ln, out=offs[1:])  # np.cumsum without its Python wrapper (a third of this function's time)
    offsets = torch.from_numpy(offs)
    total = int(offs[-1])
    if store.zero_width:  # lengths-only values: the offsets are the whole column
        values = store.values.new_empty((total, *store.values.shape[1:]))
    elif ln.size and not count_nonzero(st[1:] != st[:-1] + ln[:-1]):
        s0 = int(st[0])  # rows written together: one slice instead of a gather
        if views:
            values = store.values[s0 : s0 + total]
            store.viewed = True
        else:
            values = _clone(store.values[s0 : s0 + total])
    elif ln.size and total >= _SLICE_GATHER_MIN_MEAN * ln.size:
        # long sequences (the usual case for tokens): one slice per run of touching rows and one copy beats a
        # per-token index. On the CPU the slices and the copy are numpy's (a numpy slice costs a tenth of a
        # torch one, and np.concatenate is one single-threaded memcpy per run into the output)
        vals = store.values
        values = vals.new_empty((total, *vals.shape[1:]))
        lo, hi = _runs(st, ln)
        arr = store.np_values
        if arr is not None:
            np.concatenate([arr[a:b] for a, b in zip(lo, hi, strict=True)], out=values.numpy())
        else:
            at = 0
            for a, b in zip(lo, hi, strict=True):
                _copy_into(values[at : at + b - a], vals[a:b])
                at += b - a
    else:
        values = take(store.values, torch.from_numpy(_segment_index(st, ln)).to(device))
    # offsets are the cumulative sum of stored lengths and values hold exactly their total: valid by construction
    return RaggedTensor._trusted(values, offsets if values.is_cpu else offsets.to(values.device))
