"""A columnar batch: named columns over the same rows, dense or ragged."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from asyncflow_core.errors import BatchError
from asyncflow_core.types.ragged import RaggedTensor

Column = torch.Tensor | RaggedTensor


def column_rows(column: Column) -> int:
    """Number of rows a column holds (first dim of a dense tensor, sequences of a ragged one)."""
    if isinstance(column, RaggedTensor):
        return len(column)
    if column.dim() == 0:
        raise BatchError("a dense column needs a leading row dimension; got a 0-d tensor")
    return int(column.shape[0])


class Batch(Mapping[str, Column]):
    """Rows of samples as named columns, the unit that stages read and write.

    A dense column is a tensor whose first dimension is the row axis (e.g. a
    scalar reward per row: shape ``[n]``). A ragged column is a
    :class:`RaggedTensor` with one sequence per row (e.g. response token ids,
    per-token log-probs). Every column has the same number of rows; building a
    batch whose columns disagree raises :class:`BatchError`.

    ``row_ids`` optionally names the store rows the batch was read from (int64,
    one per row) so results can be written back to the same rows.
    """

    __slots__ = ("_columns", "_num_rows", "row_ids")

    def __init__(
        self,
        columns: Mapping[str, Column],
        *,
        row_ids: torch.Tensor | Sequence[int] | None = None,
        num_rows: int | None = None,
    ) -> None:
        counts = {name: column_rows(col) for name, col in columns.items()}
        if row_ids is not None:
            row_ids = torch.as_tensor(row_ids, dtype=torch.int64).reshape(-1)
            counts["<row_ids>"] = row_ids.numel()
        if num_rows is not None:
            counts["<num_rows>"] = num_rows
        distinct = set(counts.values())
        if len(distinct) > 1:
            detail = ", ".join(f"{k}={v}" for k, v in counts.items())
            raise BatchError(f"columns disagree on the number of rows: {detail}")
        self._columns: dict[str, Column] = dict(columns)
        self._num_rows = distinct.pop() if distinct else 0
        self.row_ids = row_ids

    @classmethod
    def _trusted(cls, columns: dict[str, Column], row_ids: torch.Tensor | None, num_rows: int) -> Batch:
        """Internal: a batch of ``columns`` (a dict the batch takes over) that the caller knows to hold
        ``num_rows`` rows each, ``row_ids`` a 1-D int64 tensor of as many (or None), without the checks of
        :meth:`__init__`. For the store's reads, which built every column for those rows itself."""
        out = object.__new__(cls)
        out._columns = columns
        out._num_rows = num_rows
        out.row_ids = row_ids
        return out

    # Mapping protocol
    def __getitem__(self, name: str) -> Column:
        try:
            return self._columns[name]
        except KeyError:
            raise KeyError(f"batch has no column {name!r}; it has {sorted(self._columns)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        """Number of columns (Mapping semantics). Use :attr:`num_rows` for rows."""
        return len(self._columns)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self._columns)

    def with_columns(self, **columns: Column) -> Batch:
        """A new batch with ``columns`` added or replaced (row count must match)."""
        return Batch({**self._columns, **columns}, row_ids=self.row_ids, num_rows=self._num_rows)

    def project(self, names: Sequence[str]) -> Batch:
        """A new batch holding only ``names`` (in that order)."""
        return Batch({n: self[n] for n in names}, row_ids=self.row_ids, num_rows=self._num_rows)

    def to(self, device: torch.device | str) -> Batch:
        """Every column on ``device`` (this batch itself when they all are already there)."""
        device = torch.device(device)
        if all(_device_of(c) == device for c in self._columns.values()):
            return self
        cols = {n: c.to(device) for n, c in self._columns.items()}
        return Batch(cols, row_ids=self.row_ids, num_rows=self._num_rows)

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> Batch:
        """Rows by index tensor/list or slice, every column alike."""
        if isinstance(index, slice):
            index = torch.arange(self._num_rows)[index]
        index = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        cols = {
            n: (c.select(index) if isinstance(c, RaggedTensor) else c[index]) for n, c in self._columns.items()
        }
        row_ids = self.row_ids[index] if self.row_ids is not None else None
        return Batch(cols, row_ids=row_ids, num_rows=index.numel())

    @staticmethod
    def cat(parts: Sequence[Batch]) -> Batch:
        """Concatenate batches with the same column names along the row axis."""
        if not parts:
            raise BatchError("cannot concatenate an empty list of batches")
        names = parts[0].columns
        for p in parts[1:]:
            if set(p.columns) != set(names):
                raise BatchError(f"cannot concatenate batches with columns {sorted(names)} and {sorted(p.columns)}")
        cols: dict[str, Column] = {}
        for n in names:
            first = parts[0][n]
            if isinstance(first, RaggedTensor):
                cols[n] = RaggedTensor.cat([p[n] for p in parts])  # type: ignore[misc]
            else:
                cols[n] = torch.cat([p[n] for p in parts])  # type: ignore[misc]
        have_ids = [p.row_ids is not None for p in parts]
        row_ids = torch.cat([p.row_ids for p in parts]) if all(have_ids) else None  # type: ignore[misc]
        return Batch(cols, row_ids=row_ids, num_rows=sum(p.num_rows for p in parts))

    @property
    def nbytes(self) -> int:
        total = 0
        for c in self._columns.values():
            total += c.nbytes if isinstance(c, RaggedTensor) else c.element_size() * c.numel()
        return total

    def __repr__(self) -> str:
        cols = ", ".join(
            f"{n}: {'ragged ' if isinstance(c, RaggedTensor) else ''}{str(c.dtype).removeprefix('torch.')}"
            for n, c in self._columns.items()
        )
        return f"Batch(rows={self._num_rows}, {{{cols}}})"


def _device_of(column: Column) -> torch.device:
    return column.values.device if isinstance(column, RaggedTensor) else column.device
