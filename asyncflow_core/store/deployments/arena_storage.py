"""The multiprocess deployment's data index: where each (row, column) value lies in the shared arena.

The server never touches payload bytes on the hot path. A producer copies a
column into an arena range it was granted (:meth:`ArenaStorage.grant`), then
sends only the range and the column's shape; the index records, per row,
``(extent, byte start, count)`` in a plain
:class:`~asyncflow_core.store.storage.StorageUnit` (as an int64 ``[n, 3]``
dense column, so row-table bookkeeping is reused, not rewritten). A read
returns those locations and pins the extents; the consumer maps them itself.

An extent (one granted range) is freed once no row references it, no reader
pins it, and no producer is still filling it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core.store.deployments.arena import ArenaAllocator, ArenaFullError, ArenaMapping
from asyncflow_core.store.deployments.codec import dtype_from_name, dtype_name
from asyncflow_core.store.errors import ColumnTypeError, InvalidRequestError, UnknownColumnError
from asyncflow_core.store.storage import ColumnSchema, StorageUnit, check_column_schema
from asyncflow_core.types import Batch, RaggedTensor


@dataclass
class _Extent:
    nbytes: int
    cells: int = 0  # (row, column) values referencing it
    pins: int = 0  # outstanding reads
    owner: int | None = None  # connection still filling it (None once put)


@dataclass
class ColumnLayout:
    """A column as a producer wrote it into the arena."""

    schema: ColumnSchema
    offset: int  #: arena byte offset of the first value
    rows: int
    lengths: torch.Tensor | None  #: per-row lengths along the token axis (ragged); None for dense

    @property
    def row_bytes(self) -> int:
        elem = torch.empty((), dtype=self.schema.dtype).element_size()
        return elem * int(torch.Size(self.schema.trailing).numel())

    @property
    def nbytes(self) -> int:
        n = int(self.lengths.sum()) if self.lengths is not None else self.rows
        return n * self.row_bytes

    @classmethod
    def from_message(cls, d: dict[str, Any]) -> ColumnLayout:
        try:
            schema = ColumnSchema(bool(d["ragged"]), dtype_from_name(d["dtype"]), tuple(int(x) for x in d["trailing"]))
            lengths = torch.as_tensor(d["lengths"], dtype=torch.int64) if schema.ragged else None
            layout = cls(schema, int(d["offset"]), int(d["rows"]), lengths)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"malformed column description in a put: {exc}") from exc
        if lengths is not None and (lengths.numel() != layout.rows or bool((lengths < 0).any())):
            raise ColumnTypeError("ragged lengths must be one non-negative length per row")
        return layout

    def locations(self, extent: int) -> torch.Tensor:
        """``[rows, 3]`` int64: extent start, byte start, count along the leading axis."""
        n = self.rows
        out = torch.empty((n, 3), dtype=torch.int64)
        out[:, 0] = extent
        rb = self.row_bytes
        if self.lengths is None:
            out[:, 1] = self.offset + torch.arange(n, dtype=torch.int64) * rb
            out[:, 2] = 1
        else:
            out[:, 1] = self.offset + (torch.cumsum(self.lengths, 0) - self.lengths) * rb
            out[:, 2] = self.lengths
        return out


@dataclass
class ArenaStorage:
    """Server-side index of arena-resident column values (see module docstring)."""

    mapping: ArenaMapping
    allocator: ArenaAllocator
    index: StorageUnit = field(default_factory=StorageUnit)
    schema: dict[str, ColumnSchema] = field(default_factory=dict)
    extents: dict[int, _Extent] = field(default_factory=dict)
    pins: dict[int, list[int]] = field(default_factory=dict)
    _next_pin: int = 0

    # -- producer side -----------------------------------------------------------

    def grant(self, sizes: list[int], owner: int) -> list[int]:
        """Reserve one range per size for connection ``owner``; all or none (``ArenaFullError``)."""
        got: list[int] = []
        try:
            for size in sizes:
                if size < 0:
                    raise InvalidRequestError(f"cannot reserve {size} bytes")
                if size > self.allocator.nbytes:
                    raise InvalidRequestError(
                        f"a column of {size} bytes is larger than the whole shared arena "
                        f"({self.allocator.nbytes} bytes); raise the store's arena_mb or put fewer rows at a time"
                    )
                off = self.allocator.alloc(size)
                self.extents[off] = _Extent(size, owner=owner)
                got.append(off)
        except BaseException:
            for off in got:
                self._free_extent(off)
            raise
        return got

    def abandon(self, offsets: list[int]) -> None:
        """A producer gave up on granted ranges (failed put)."""
        for off in offsets:
            ext = self.extents.get(off)
            if ext is not None and ext.owner is not None:
                ext.owner = None
                self._maybe_free(off)

    def abandon_owner(self, owner: int) -> None:
        """A connection went away: its unfinished ranges are free again."""
        for off, ext in list(self.extents.items()):
            if ext.owner == owner:
                ext.owner = None
                self._maybe_free(off)

    def validate(self, n: int, layouts: dict[str, ColumnLayout], extents: dict[str, int], owner: int) -> None:
        """``ColumnTypeError`` / ``InvalidRequestError`` unless the write is consistent; mutates nothing."""
        for name, lay in layouts.items():
            if not isinstance(name, str) or not name:
                raise ColumnTypeError(f"column names must be non-empty strings, got {name!r}")
            if lay.rows != n:
                raise ColumnTypeError(
                    f"column {name!r} holds {lay.rows} rows but {n} rows are being written; "
                    "give every column one value (or sequence) per row"
                )
            check_column_schema(name, self.schema.get(name), lay.schema)
            ext = self.extents.get(extents.get(name, -1))
            if ext is None or ext.owner != owner or lay.offset != extents[name] or lay.nbytes > ext.nbytes:
                raise InvalidRequestError(f"column {name!r} does not lie in a range granted to this client")

    def write(self, row_ids: torch.Tensor, layouts: dict[str, ColumnLayout], extents: dict[str, int]) -> None:
        """Index the written ranges for ``row_ids`` (already validated), replacing older values."""
        for name, lay in layouts.items():
            self.schema.setdefault(name, lay.schema)
            self._unref(row_ids, [name])
            self.index.write(row_ids, {name: lay.locations(extents[name])})
            ext = self.extents[extents[name]]
            ext.cells += lay.rows
            ext.owner = None
            self._maybe_free(extents[name])

    # -- consumer side -----------------------------------------------------------

    def locate(self, row_ids: torch.Tensor, columns: list[str]) -> tuple[dict[str, Any], int]:
        """Per column ``{ragged, dtype, trailing, loc}`` and a pin id that keeps the ranges alive until unpinned."""
        for name in columns:
            if name not in self.schema:
                raise UnknownColumnError(f"column {name!r} was never written; written columns: {sorted(self.schema)}")
        batch = self.index.read(row_ids, columns)
        out: dict[str, Any] = {}
        used: set[int] = set()
        for name in columns:
            loc = batch[name]
            s = self.schema[name]
            out[name] = {"ragged": s.ragged, "dtype": dtype_name(s.dtype), "trailing": list(s.trailing), "loc": loc}
            if loc.numel():
                used.update(torch.unique(loc[:, 0]).tolist())
        self._next_pin += 1
        pin = self._next_pin
        for off in used:
            self.extents[off].pins += 1
        self.pins[pin] = sorted(used)
        return out, pin

    def unpin(self, pin: int) -> None:
        for off in self.pins.pop(int(pin), ()):
            ext = self.extents.get(off)
            if ext is not None:
                ext.pins -= 1
                self._maybe_free(off)

    # -- freeing -----------------------------------------------------------------

    def _unref(self, row_ids: torch.Tensor, columns: list[str]) -> None:
        for name in columns:
            if name not in self.schema or row_ids.numel() == 0:
                continue
            has = self.index.has(row_ids, name)
            if not bool(has.any()):
                continue
            loc = self.index.read(row_ids[has], [name])[name]
            offs, counts = torch.unique(loc[:, 0], return_counts=True)
            for off, k in zip(offs.tolist(), counts.tolist(), strict=True):
                self.extents[off].cells -= k
                self._maybe_free(off)

    def free(self, row_ids: torch.Tensor) -> None:
        """Rows were dropped: release their references and forget them."""
        self._unref(row_ids, list(self.schema))
        self.index.free(row_ids)

    def _maybe_free(self, off: int) -> None:
        ext = self.extents.get(off)
        if ext is not None and ext.cells <= 0 and ext.pins <= 0 and ext.owner is None:
            self._free_extent(off)

    def _free_extent(self, off: int) -> None:
        ext = self.extents.pop(off)
        self.allocator.free(off, ext.nbytes)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.extents.values() if e.owner is None)

    # -- checkpoint --------------------------------------------------------------

    def materialize(self, row_ids: torch.Tensor, columns: list[str]) -> Batch:
        """Copies of the values (for checkpoints), read from this process's mapping."""
        located, pin = self.locate(row_ids, columns)
        try:
            cols = {n: read_column(self.mapping, d, copy=True) for n, d in located.items()}
        finally:
            self.unpin(pin)
        return Batch(cols, row_ids=row_ids, num_rows=row_ids.numel())

    def state_dict(self) -> dict[str, Any]:
        """Same format as :meth:`StorageUnit.state_dict`, so checkpoints move between deployments."""
        cols: dict[str, Any] = {}
        for name, s in self.schema.items():
            loc_state = self.index.state_dict()["columns"].get(name)
            ids = loc_state["row_ids"] if loc_state is not None else torch.empty(0, dtype=torch.int64)
            data = self.materialize(ids, [name])[name] if ids.numel() else (
                RaggedTensor.empty(s.dtype, s.trailing) if s.ragged else torch.empty((0, *s.trailing), dtype=s.dtype)
            )
            cols[name] = {"ragged": s.ragged, "dtype": dtype_name(s.dtype), "trailing": s.trailing,
                          "row_ids": ids, "data": data}
        return {"format": 1, "columns": cols}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace everything with a storage ``state_dict`` (copies values into fresh arena ranges)."""
        if not isinstance(state, dict) or state.get("format") != 1:
            raise InvalidRequestError("not a storage state_dict (format 1); pass what state_dict() returned")
        for off in [o for o, e in self.extents.items() if e.owner is None]:
            self._free_extent(off)
        self.index = StorageUnit()
        self.schema = {}
        self.pins.clear()
        for name, c in state["columns"].items():
            ids = torch.as_tensor(c["row_ids"], dtype=torch.int64)
            data = c["data"]
            self.schema[name] = ColumnSchema(bool(c["ragged"]), dtype_from_name(c["dtype"]), tuple(c["trailing"]))
            if ids.numel() == 0:
                continue
            payload = data.values if isinstance(data, RaggedTensor) else data
            payload = payload.contiguous()
            nbytes = payload.numel() * payload.element_size()
            (off,) = self.grant([nbytes], owner=-1)
            self.mapping.tensor(off, nbytes).copy_(payload.reshape(-1).view(torch.uint8))
            lay = ColumnLayout(self.schema[name], off, ids.numel(),
                               data.lengths if isinstance(data, RaggedTensor) else None)
            self.write(ids, {name: lay}, {name: off})


def read_column(mapping: ArenaMapping, d: dict[str, Any], *, copy: bool) -> Any:
    """Build a column from its arena locations: views when ``copy`` is False and the rows lie back to
    back, else a gathered copy."""
    col, _ = read_column_ex(mapping, d, copy=copy)
    return col


def read_column_ex(mapping: ArenaMapping, d: dict[str, Any], *, copy: bool) -> tuple[Any, Any]:
    """As :func:`read_column`, plus the memoryview keeping a zero-copy result's range alive (None if copied)."""
    dtype = dtype_from_name(d["dtype"])
    trailing = tuple(int(x) for x in d["trailing"])
    ragged = bool(d["ragged"])
    loc: torch.Tensor = d["loc"]
    n = loc.shape[0]
    elem = torch.empty((), dtype=dtype).element_size()
    per = int(torch.Size(trailing).numel())
    rb = elem * per
    starts, counts = loc[:, 1], loc[:, 2]
    total = int(counts.sum()) if n else 0
    keep = None
    if n == 0 or total == 0:
        values = torch.empty((0, *trailing), dtype=dtype)
    elif (n == 1 or bool((starts[1:] == starts[:-1] + counts[:-1] * rb).all())) and not copy:
        raw, keep = mapping.owned_view(int(starts[0]), total * rb)
        values = raw.view(dtype).reshape(total, *trailing)
    elif n == 1 or bool((starts[1:] == starts[:-1] + counts[:-1] * rb).all()):
        values = mapping.tensor(int(starts[0]), total * rb).view(dtype).reshape(total, *trailing).clone()
    else:
        # rows scattered over the arena: one vectorised gather (element starts are aligned to the dtype)
        usable = mapping.nbytes - mapping.nbytes % elem
        flat = mapping.bytes[:usable].view(dtype)
        el_starts, el_counts = starts // elem, counts * per
        offs = torch.cumsum(el_counts, 0) - el_counts
        seg = torch.repeat_interleave(torch.arange(n), el_counts, output_size=total * per)
        idx = el_starts[seg] + (torch.arange(total * per, dtype=torch.int64) - offs[seg])
        values = flat[idx].reshape(total, *trailing)
    if ragged:
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return RaggedTensor(values, offsets), keep
    return values.reshape(n, *trailing), keep


__all__ = ["ArenaFullError", "ArenaStorage", "ColumnLayout", "read_column", "read_column_ex"]
