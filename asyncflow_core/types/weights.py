"""Weight buckets: named tensors packed into flat byte buffers for transport."""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from asyncflow_core.errors import WeightTransferError

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

BUCKET_ALIGNMENT = 64  #: byte alignment of every tensor inside a bucket buffer


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name carried in metadata)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightTransferError(f"unknown dtype {name!r} in weight metadata; known: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lives inside a bucket buffer.

    ``offset`` is in bytes from the start of the bucket's buffer and is a
    multiple of :data:`BUCKET_ALIGNMENT`; the tensor is contiguous.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class WeightBucket:
    """A fixed-size group of tensors of one weight version, packed in one uint8 buffer.

    ``checksum`` is the BLAKE2b digest of ``buffer`` computed by the sender;
    receivers call :meth:`verify` before using the tensors.
    """

    version: int
    index: int  #: position of this bucket in its version's export, from 0
    metas: tuple[TensorMeta, ...]
    buffer: torch.Tensor  #: 1-D uint8, contiguous
    checksum: str
    last: bool  #: True on the final bucket of a version

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into the buffer (no copy)."""
        for m in self.metas:
            raw = self.buffer[m.offset : m.offset + m.nbytes]
            yield m.name, raw.view(dtype_from_name(m.dtype)).view(m.shape)

    def verify(self) -> None:
        """Raise :class:`WeightTransferError` if the buffer does not match its checksum."""
        actual = buffer_checksum(self.buffer)
        if actual != self.checksum:
            raise WeightTransferError(
                f"weight bucket {self.index} of version {self.version} is corrupted: checksum {actual} "
                f"!= {self.checksum} sent"
            )


def buffer_checksum(buffer: torch.Tensor) -> str:
    """BLAKE2b-128 hex digest of a uint8 CPU or device buffer."""
    data = buffer.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    return hashlib.blake2b(memoryview(data.numpy()), digest_size=16).hexdigest()


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, bucket_bytes: int
) -> Iterator[WeightBucket]:
    """Pack ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Tensors
    are copied once, into the bucket buffer, in the order given.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    index = 0

    def flush(last: bool) -> WeightBucket:
        nonlocal pending, size, index
        metas = []
        offset = 0
        for name, t in pending:
            metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset))
            offset = _align(offset + t.numel() * t.element_size())
        device = pending[0][1].device if pending else torch.device("cpu")
        buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
        for meta, (_, t) in zip(metas, pending, strict=True):
            buffer[meta.offset : meta.offset + meta.nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        bucket = WeightBucket(version, index, tuple(metas), buffer, buffer_checksum(buffer), last)
        pending, size, index = [], 0, index + 1
        return bucket

    items = iter(named_tensors)
    current = next(items, None)
    while current is not None:
        nxt = next(items, None)
        name, t = current
        nbytes = _align(t.numel() * t.element_size())
        if pending and size + nbytes > bucket_bytes:
            yield flush(last=False)
        pending.append((name, t))
        size += nbytes
        current = nxt
    yield flush(last=True)


class ModelTensors:
    """What a rollout engine's model takes in a weight update: every name with its shape and dtype, and tied names.

    Names are the model's ``state_dict`` keys (Hugging Face names for the
    shipped engines). A tied group (one tensor under several names, e.g. the
    input embedding and the output projection) is covered by any one of its
    names. Build it with :meth:`of` from the model's named tensors, which
    finds the tied groups by tensor identity.
    """

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 tied: Iterable[Iterable[str]] = ()) -> None:
        self.specs = {name: (tuple(shape), dtype) for name, (shape, dtype) in specs.items()}
        self.group_of: dict[str, int] = {}
        for i, group in enumerate(tied):
            for name in group:
                if name not in self.specs:
                    raise ValueError(f"tied name {name!r} is not one of the model's tensors")
                self.group_of[name] = i

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> ModelTensors:
        """From ``name -> tensor`` (parameters and buffers); names of the same tensor object form a tied group."""
        items = list(named.items() if isinstance(named, Mapping) else named)
        by_id: dict[int, list[str]] = {}
        for name, t in items:
            by_id.setdefault(id(t), []).append(name)
        return cls({name: (tuple(t.shape), t.dtype) for name, t in items},
                   [names for names in by_id.values() if len(names) > 1])

    @property
    def tied_groups(self) -> list[list[str]]:
        """Each tied group's names, in the model's order (only groups of two or more)."""
        groups: dict[int, list[str]] = {}
        for name in self.specs:
            if name in self.group_of:
                groups.setdefault(self.group_of[name], []).append(name)
        return list(groups.values())

    def check(self, meta: TensorMeta) -> None:
        """Raise :class:`WeightTransferError` unless ``meta`` names a tensor of the model with its shape and dtype."""
        expected = self.specs.get(meta.name)
        if expected is None:
            example = next(iter(self.specs), "")
            raise WeightTransferError(
                f"{meta.name!r} is not a tensor of this model (names are the model's state_dict keys, "
                f"e.g. {example!r})"
            )
        shape, dtype = expected
        if tuple(meta.shape) != shape:
            raise WeightTransferError(f"{meta.name}: shape {tuple(meta.shape)} does not match the model's {shape}")
        if meta.dtype != dtype_name(dtype):
            raise WeightTransferError(
                f"{meta.name}: dtype {meta.dtype} does not match the model's {dtype_name(dtype)} "
                "(export weights in the model's dtype)"
            )

    def missing(self, names: Iterable[str]) -> list[str]:
        """The model's tensors that ``names`` leave unset (a tied group counts as set when any of its names is)."""
        sent = set(names)
        groups = {self.group_of[n] for n in sent if n in self.group_of}
        return [n for n in self.specs if n not in sent and self.group_of.get(n, -1) not in groups]


async def collect_update(version: int, buckets: AsyncIterable[WeightBucket], *,
                         model: ModelTensors | None = None) -> list[WeightBucket]:
    """Every bucket of the update to ``version``, checked before anything of it is applied.

    The checks a rollout engine owes the weight-update contract (a refused
    update changes nothing): each bucket's checksum; every bucket of
    ``version``; no tensor sent twice; a final bucket marked ``last``; and,
    with ``model``, every name known with the model's shape and dtype and
    every tensor of the model covered. Raises :class:`WeightTransferError`
    saying which check failed.
    """
    received: list[WeightBucket] = []
    names: set[str] = set()
    async for bucket in buckets:
        bucket.verify()
        if bucket.version != version:
            raise WeightTransferError(
                f"bucket {bucket.index} belongs to version {bucket.version}, not to the update to version {version}"
            )
        for meta in bucket.metas:
            if model is not None:
                model.check(meta)
            if meta.name in names:
                raise WeightTransferError(f"{meta.name!r} was sent twice in the update to version {version}")
            names.add(meta.name)
        received.append(bucket)
    if not received:
        raise WeightTransferError(f"the update to version {version} carried no weight buckets")
    if not received[-1].last:
        raise WeightTransferError(f"the update to version {version} ended before its last bucket")
    if model is not None:
        missing = model.missing(names)
        if missing:
            raise WeightTransferError(
                f"the update to version {version} left {len(missing)} of the model's tensors unset, e.g. {missing[:3]}"
            )
    return received


def _align(n: int) -> int:
    return (n + BUCKET_ALIGNMENT - 1) // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT
