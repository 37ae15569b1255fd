"""Ragged sequences stored packed: one values tensor plus offsets, no padding."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncflow_core.errors import BatchError

IndexLike = int | slice | Sequence[int] | torch.Tensor


@dataclass(frozen=True, eq=False)
class RaggedTensor:
    """A list of variable-length sequences packed into one tensor.

    Sequence ``i`` is ``values[offsets[i]:offsets[i + 1]]``. ``offsets`` is a
    1-D int64 tensor of length ``len(self) + 1`` that starts at 0, never
    decreases and ends at ``values.shape[0]``. Trailing dimensions of
    ``values`` (e.g. a hidden size) are allowed and kept.

    Nothing is padded: this is the layout the store keeps and the layout
    trainers pack micro-batches from. ``to_padded`` exists for engines that
    need a rectangle.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        offsets = self.offsets
        if offsets.dim() != 1 or offsets.dtype != torch.int64:
            raise BatchError(
                f"offsets must be a 1-D int64 tensor, got dtype {offsets.dtype} "
                f"with shape {tuple(offsets.shape)}"
            )
        if offsets.numel() == 0:
            raise BatchError("offsets must hold at least one element (0) for an empty tensor")
        if self.values.dim() == 0:
            raise BatchError("values must have at least one dimension (the packed token axis)")
        # checked in numpy on the CPU: four torch calls per construction, each releasing the GIL, were a
        # visible share of the driver's step (docs/performance.md, "Against TRL's GRPOTrainer")
        o = offsets.numpy() if offsets.device.type == "cpu" and not offsets.requires_grad else offsets.cpu().numpy()
        if int(o[0]) != 0 or int(o[-1]) != self.values.shape[0]:
            raise BatchError(
                f"offsets must start at 0 and end at values.shape[0]={self.values.shape[0]}, "
                f"got {int(o[0])}..{int(o[-1])}"
            )
        if o.size > 1 and bool((o[1:] < o[:-1]).any()):
            raise BatchError("offsets must be non-decreasing")

    @classmethod
    def _trusted(cls, values: torch.Tensor, offsets: torch.Tensor) -> RaggedTensor:
        """Internal: wrap ``values`` and ``offsets`` that the caller built itself and knows to be valid (1-D
        int64 offsets from 0, non-decreasing, ending at ``values.shape[0]``), without the checks above.

        For the store's reads, whose offsets are a cumulative sum of its own lengths; every public way of
        building a ragged tensor keeps its checks."""
        out = object.__new__(cls)
        d = out.__dict__  # frozen: fields are set the way dataclasses' own __init__ sets them
        d["values"] = values
        d["offsets"] = offsets
        return out

    # -- construction -------------------------------------------------------

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[torch.Tensor | Sequence[int] | Sequence[float]],
        *,
        dtype: torch.dtype | None = None,
    ) -> RaggedTensor:
        """Pack a list of 1-D (or N-D with a common trailing shape) sequences.

        Plain Python lists are accepted; ``dtype`` picks their tensor dtype
        (default: what ``torch.as_tensor`` infers, int64 for ints).
        """
        tensors = [torch.as_tensor(s, dtype=dtype) for s in sequences]
        lengths = torch.tensor([t.shape[0] if t.dim() else -1 for t in tensors], dtype=torch.int64)
        if bool((lengths < 0).any()):
            raise BatchError("every sequence must have at least one dimension")
        offsets = torch.zeros(len(tensors) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if tensors:
            trailing = {tuple(t.shape[1:]) for t in tensors}
            if len(trailing) > 1:
                raise BatchError(f"sequences disagree on trailing shape: {sorted(trailing)}")
            values = torch.cat(tensors) if len(tensors) > 1 else tensors[0].clone()
        else:
            values = torch.empty(0, dtype=dtype or torch.int64)
        return cls(values, offsets)

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> RaggedTensor:
        """Wrap already-packed ``values`` split by per-sequence ``lengths``."""
        lengths_t = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths_t.dim() == 1 and lengths_t.device.type == "cpu":
            # numpy on the CPU: no torch dispatch per step (the driver builds one of these per column per flush)
            ln = lengths_t.numpy()
            if np.count_nonzero(ln < 0):
                raise BatchError("lengths must be a 1-D tensor of non-negative integers")
            offs = np.empty(ln.size + 1, dtype=np.int64)
            offs[0] = 0
            np.add.accumulate(ln, out=offs[1:])
            offsets = torch.from_numpy(offs)
            if values.dim() and int(offs[-1]) == values.shape[0]:
                return cls._trusted(values, offsets)  # from 0, non-decreasing (lengths >= 0), ends at the values
            return cls(values, offsets)  # raises the checks' own error
        if lengths_t.dim() != 1 or bool((lengths_t < 0).any()):
            raise BatchError("lengths must be a 1-D tensor of non-negative integers")
        offsets = torch.zeros(lengths_t.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths_t, 0, out=offsets[1:])
        return cls(values, offsets)

    @classmethod
    def empty(cls, dtype: torch.dtype = torch.int64, trailing_shape: tuple[int, ...] = ()) -> RaggedTensor:
        """A ragged tensor holding no sequences."""
        return cls(torch.empty((0, *trailing_shape), dtype=dtype), torch.zeros(1, dtype=torch.int64))

    # -- shape --------------------------------------------------------------

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """Per-sequence lengths (int64, one per sequence)."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def numel_packed(self) -> int:
        """Number of packed elements along the token axis (sum of lengths)."""
        return int(self.values.shape[0])

    @property
    def nbytes(self) -> int:
        return self.values.element_size() * self.values.numel() + 8 * self.offsets.numel()

    # -- access -------------------------------------------------------------

    def __getitem__(self, index: IndexLike) -> torch.Tensor | RaggedTensor:
        """``rt[i]`` is one sequence (a view); ``rt[a:b]`` or ``rt[[i, j]]`` a RaggedTensor."""
        if isinstance(index, int):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"sequence index {index} out of range for {n} sequences")
            index %= n
            return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                stop = max(start, stop)
                lo, hi = int(self.offsets[start]), int(self.offsets[stop])
                return RaggedTensor(self.values[lo:hi], self.offsets[start : stop + 1] - lo)
            return self.select(torch.tensor(list(range(start, stop, step)), dtype=torch.int64))
        return self.select(torch.as_tensor(index, dtype=torch.int64))

    def select(self, index: torch.Tensor) -> RaggedTensor:
        """Gather sequences by an index tensor (any order, repeats allowed), vectorised."""
        index = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        n = len(self)
        if index.numel() and (int(index.min()) < -n or int(index.max()) >= n):
            raise IndexError(f"sequence index out of range for {n} sequences")
        index = index % max(n, 1)
        if index.numel() > 1 and bool((index[1:] - index[:-1] == 1).all()):
            # consecutive sequences (the common case: a whole batch or a run of it): one slice, no gather
            a, b = int(index[0]), int(index[-1]) + 1
            lo = self.offsets[a]
            return RaggedTensor(self.values[int(lo) : int(self.offsets[b])].clone(), self.offsets[a : b + 1] - lo)
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        if index.numel() and int(lengths.sum()) >= 32 * index.numel():
            # long sequences: one slice per row and one copy beats building a per-element index
            new_offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=new_offsets[1:])
            v = self.values
            parts = [v[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
            return RaggedTensor(torch.cat(parts), new_offsets)
        new_offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=new_offsets[1:])
        total = int(new_offsets[-1])
        # position of every output element in the packed input
        seq_of_elem = torch.repeat_interleave(torch.arange(index.numel()), lengths, output_size=total)
        within = torch.arange(total, dtype=torch.int64) - new_offsets[:-1][seq_of_elem]
        gather = starts[seq_of_elem] + within
        return RaggedTensor(self.values[gather], new_offsets)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def to_list(self) -> list[list]:
        """Plain nested Python lists (for tests, JSON and debugging)."""
        return [seq.tolist() for seq in self]

    def to_padded(self, pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(padded [n, max_len, ...], mask [n, max_len] bool)`` for engines that need a rectangle."""
        n = len(self)
        lengths = self.lengths
        max_len = int(lengths.max()) if n else 0
        out = torch.full((n, max_len, *self.values.shape[1:]), pad_value, dtype=self.values.dtype)
        mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
        out[mask] = self.values
        return out, mask

    @classmethod
    def from_padded(cls, padded: torch.Tensor, mask: torch.Tensor) -> RaggedTensor:
        """Inverse of :meth:`to_padded`; ``mask`` must be left-aligned (prefix of True per row)."""
        lengths = mask.sum(dim=1).to(torch.int64)
        return cls.from_lengths(padded[mask], lengths)

    # -- combination --------------------------------------------------------

    @staticmethod
    def cat(parts: Sequence[RaggedTensor]) -> RaggedTensor:
        """Concatenate along the sequence axis (sequences of ``parts[0]`` come first)."""
        if not parts:
            raise BatchError("cannot concatenate an empty list of ragged tensors")
        dtypes = {p.dtype for p in parts}
        if len(dtypes) > 1:
            raise BatchError(f"cannot concatenate ragged tensors of different dtypes: {sorted(map(str, dtypes))}")
        values = torch.cat([p.values for p in parts])
        if all(p.offsets.device.type == "cpu" for p in parts):
            # offsets joined in numpy (each part's shifted by the values before it), no torch op per part
            pieces = [p.offsets.numpy() for p in parts]
            offs = np.empty(sum(o.size for o in pieces) - len(pieces) + 1, dtype=np.int64)
            offs[0] = 0
            at, base = 1, 0
            for o in pieces:
                k = o.size - 1
                np.add(o[1:], base - int(o[0]), out=offs[at : at + k])
                at += k
                base += int(o[-1]) - int(o[0])
            return RaggedTensor(values, torch.from_numpy(offs))  # checked as any construction is
        lengths = torch.cat([p.lengths for p in parts])
        return RaggedTensor.from_lengths(values, lengths)

    def equal(self, other: object) -> bool:
        """Exact equality of packed values and offsets (dtype included)."""
        return (
            isinstance(other, RaggedTensor)
            and self.values.dtype == other.values.dtype
            and torch.equal(self.offsets, other.offsets)
            and torch.equal(self.values, other.values)
        )

    def to(self, *args, **kwargs) -> RaggedTensor:
        """Move/cast the values (offsets stay int64; they move device with values)."""
        values = self.values.to(*args, **kwargs)
        return RaggedTensor(values, self.offsets.to(values.device))

    def __repr__(self) -> str:
        return (
            f"RaggedTensor(n={len(self)}, packed={self.numel_packed}, dtype={self.values.dtype}, "
            f"trailing={tuple(self.values.shape[1:])})"
        )
