"""Weight buckets: named tensors packed into flat byte buffers for transport."""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import threading
import weakref
from collections.abc import AsyncIterable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

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

    ``checksum`` is the :func:`weight_digest` of ``buffer`` computed by the
    sender; receivers call :meth:`verify` (or :func:`verify_buckets`) before
    using the tensors. A bucket remembers that its buffer matched its
    checksum together with the buffer's torch version counter, so checking
    it again (the transport, then ``collect_update``) costs nothing until the
    buffer is written in place through torch. :func:`pack_buckets` gives its
    buckets that memory at birth (it computed the checksum from that very
    buffer), so a receiver in the sender's process does not hash them again;
    a write that bypasses torch's version counter (a numpy view, a raw
    pointer, another process) is not seen by that memory. The memory is per
    object: a copy or pickle of the bucket is verified afresh.
    """

    version: int
    index: int  #: position of this bucket in its version's export, from 0
    metas: tuple[TensorMeta, ...]
    buffer: torch.Tensor  #: 1-D uint8, contiguous
    checksum: str
    last: bool  #: True on the final bucket of a version
    #: ``buffer._version`` when this object last verified, else None (not compared, copied or pickled)
    _verified_at: int | None = field(default=None, init=False, repr=False, compare=False)

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
        verify_buckets([self])

    @property
    def verified(self) -> bool:
        """True when this object verified its buffer and the buffer was not written in place since."""
        return self._verified_at is not None and self._verified_at == self.buffer._version

    def _mark_verified(self) -> None:
        object.__setattr__(self, "_verified_at", self.buffer._version)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_verified_at"] = None  # a copy that crossed a process boundary verifies again
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__["_verified_at"] = None


# ------------------------------------------------------------------ the digest
#
# The one digest of weight buffers: every producer (``pack_buckets``, the
# trainers' exports) and every checker (``WeightBucket.verify``, the
# transports, the engines' workers) calls the functions below.
#
# Definition: split the buffer's bytes into consecutive spans of
# DIGEST_SPAN_BYTES (the last shorter; one empty span for an empty buffer),
# take the XXH3-128 digest (16 bytes, big-endian, as ``xxhash`` returns it)
# of each span, and return the lowercase hex XXH3-128 of
# ``len(buffer) as 8 bytes little-endian || leaf digests in order``.
# Spans hash independently, on threads (xxhash releases the GIL).
#
# Guarantee: a checksum against accidents — a flipped or zeroed byte, a
# truncated or extended buffer, spans or buckets swapped, stale bytes from
# another version — not against an adversary: XXH3 is not cryptographic, and
# anyone who can write the buffer can also write a matching digest.

DIGEST_NAME = "xxh3-128-tree/8MiB"  #: the digest's name in docs and manifests
DIGEST_SPAN_BYTES = 8 << 20

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def digest_pool() -> ThreadPoolExecutor:
    """The threads digests (and the copies fused with them) run on: one per usable CPU, at most 8."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            try:
                cpus = len(os.sched_getaffinity(0))
            except AttributeError:  # not on Linux
                cpus = os.cpu_count() or 1
            _POOL = ThreadPoolExecutor(max(1, min(8, cpus)), thread_name_prefix="asyncflow-digest")
        return _POOL


def _reset_pool_in_child() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_in_child)


def digest_spans(nbytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the spans a buffer of ``nbytes`` is hashed in (one empty span when ``nbytes`` is 0)."""
    return [(a, min(a + DIGEST_SPAN_BYTES, nbytes)) for a in range(0, nbytes, DIGEST_SPAN_BYTES)] or [(0, 0)]


def digest_leaf(data) -> bytes:
    """XXH3-128 of one span (any object with the buffer protocol); releases the GIL."""
    return xxhash.xxh3_128_digest(data)


def digest_root(nbytes: int, leaves: Sequence[bytes]) -> str:
    """The digest of a buffer of ``nbytes`` from its spans' leaf digests, in order."""
    return xxhash.xxh3_128_hexdigest(nbytes.to_bytes(8, "little") + b"".join(leaves))


def host_bytes(buffer: torch.Tensor) -> memoryview:
    """The bytes of a tensor as a flat memoryview (no copy for a contiguous CPU tensor)."""
    data = buffer.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    return memoryview(data.numpy())


def weight_digests(buffers: Sequence[torch.Tensor]) -> list[str]:
    """:func:`weight_digest` of each buffer, every span of every buffer hashed in parallel."""
    views = [host_bytes(b) for b in buffers]
    jobs = [(i, a, b) for i, v in enumerate(views) for a, b in digest_spans(len(v))]
    if len(jobs) == 1:
        leaves = [digest_leaf(views[0])]
    else:
        leaves = list(digest_pool().map(lambda job: digest_leaf(views[job[0]][job[1] : job[2]]), jobs))
    out: list[list[bytes]] = [[] for _ in views]
    for (i, _, _), leaf in zip(jobs, leaves, strict=True):
        out[i].append(leaf)
    return [digest_root(len(v), parts) for v, parts in zip(views, out, strict=True)]


def _host_view(t: torch.Tensor):
    """A contiguous CPU tensor's bytes as a flat writable numpy uint8 array (no copy); None for any other tensor."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_quantized or t.is_sparse or t.is_complex():
        return None
    flat = t.detach().reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()


def copy_tensors(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)`` pair; host pairs in 8 MiB spans on the digest threads.

    A pair of contiguous CPU tensors of one dtype and shape is copied as
    ``numpy.copyto`` of byte spans of :data:`DIGEST_SPAN_BYTES` on
    :func:`digest_pool` (the GIL is released; ``dst``'s version counter is
    bumped, as ``copy_`` would); any other pair with ``copy_``. Why: torch
    splits one large copy over its intra-op threads and waits for all of
    them, so on a busy host one descheduled thread stalls the whole copy,
    while spans on a pool are taken by whichever thread runs
    (docs/performance.md, "Copies on a busy host" and "Weight sync").
    """
    jobs = []
    with torch.no_grad():
        for dst, src in pairs:
            d = _host_view(dst) if dst.dtype == src.dtype and dst.shape == src.shape else None
            s = _host_view(src) if d is not None else None
            if d is None or s is None:
                dst.copy_(src)
                continue
            jobs += [(d[a:b], s[a:b]) for a, b in digest_spans(d.size) if b > a]
            torch.autograd.graph.increment_version(dst)
    if len(jobs) <= 1:
        for d, s in jobs:
            np.copyto(d, s)
        return
    list(digest_pool().map(lambda job: np.copyto(*job), jobs))


class LoadInterrupted(WeightTransferError):
    """A load failed after it began to change the model: the model holds a mix of two versions."""


def _viewable(target: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``target`` can take ``src``'s memory as it is: a plain dense tensor of the same device, dtype and
    shape, ``src`` contiguous (as a bucket's tensors are)."""
    return (type(target) in (torch.Tensor, torch.nn.Parameter) and type(src) is torch.Tensor
            and target.layout == torch.strided and src.layout == torch.strided and target.numel() > 0
            and target.device == src.device and target.dtype == src.dtype and target.shape == src.shape
            and src.is_contiguous() and not target.is_quantized)


class WeightLoader:
    """Loads weight versions into a model's named tensors, by view where it may: no copy.

    ``named`` are the model's tensors by name (``state_dict(keep_vars=True)``:
    the parameter and buffer objects themselves; names of one object are
    tied). :meth:`load` takes each received ``(name, tensor)`` (views of the
    verified buckets) and, with ``views`` on, makes the model's tensor *a
    view of the received one* (``tensor.data = received``: the model reads
    the bucket's bytes, nothing is copied) when both are plain dense tensors
    of the same device, dtype and shape. The model then holds the version's
    buffers, and with them the version: an ``ExportArena`` slot is not
    reused, a ``shm`` slot stays locked, until the next load rebinds the
    tensors and the old buffers' last user goes. Other tensors are copied:

    - into the tensor's own memory (``copy_tensors``) when it never took a
      view, e.g. a CUDA model fed host buckets;
    - into fresh memory the tensor then takes, when it holds a received
      buffer but the new source cannot be viewed: a received buffer is
      never written.

    A tensor is rebound the first time only when nothing but the model's
    named tensors uses its memory (the storage's use count) and no other
    named tensor overlaps it; a model that keeps another alias of a
    weight (a cached transpose, a packed copy) is copied into instead, so
    the alias sees the new bytes. Tied names share one object, so the tie
    holds. The model must not write its tensors in place while they view
    a bucket (the engines do not): an in-process sender's buffers and a
    ``shm`` receiver's private mapping would take the write.

    A load makes every decision, and fills any fresh memory, before it
    changes the model; a failure after that point (a copy that raises) is
    :class:`LoadInterrupted`. Rebinding itself cannot fail half way.
    """

    def __init__(self, named: Mapping[str, torch.Tensor], *, views: bool = True) -> None:
        self.named = dict(named)
        self.views = views and _storage_users(torch.empty(0)) is not None
        self._viewing: set[int] = set()  #: ids of the tensors whose memory is a received buffer
        self._stats = {"loads": 0, "viewed_bytes": 0, "copied_bytes": 0}

    def load(self, received: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put ``received`` (names of ``named``, checked by the caller) into the model; see the class docstring."""
        chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, src in received:
            target = self.named[name]
            chosen[id(target)] = (target, src.detach())  # a tied group sent under two names: the last one wins
        own = self._exclusive() if self.views else set()
        rebind: list[tuple[torch.Tensor, torch.Tensor]] = []
        copy: list[tuple[torch.Tensor, torch.Tensor]] = []
        fill: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, (target, src) in chosen.items():
            if self.views and _viewable(target, src) and (key in self._viewing or key in own):
                rebind.append((target, src))
            elif key in self._viewing:  # never write a received buffer: fresh memory for this one
                fresh = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                fill.append((fresh, src))
                rebind.append((target, fresh))
            else:
                copy.append((target, src))
        copy_tensors(fill)  # nothing of the model has changed yet: a failure here leaves it as it was
        try:
            copy_tensors(copy)
        except BaseException as exc:
            raise LoadInterrupted(f"loading weights failed half way ({type(exc).__name__}: {exc}); the model "
                                  "holds a mix of two versions") from exc
        fresh_ids = {id(f) for f, _ in fill}
        with torch.no_grad():
            for target, src in rebind:
                target.data = src  # swaps the tensor's memory; the model's modules hold this very object
                if id(src) in fresh_ids:
                    self._viewing.discard(id(target))
                else:
                    self._viewing.add(id(target))
        nbytes = lambda pairs: sum(t.numel() * t.element_size() for t, _ in pairs)  # noqa: E731
        self._stats["loads"] += 1
        self._stats["viewed_bytes"] += nbytes(rebind) - nbytes(fill)
        self._stats["copied_bytes"] += nbytes(copy) + nbytes(fill)

    def _exclusive(self) -> set[int]:
        """Ids of the named tensors that may take a view the first time: no user of their memory but named tensors,
        and no named tensor overlapping another."""
        extra = _storage_users(torch.empty(1)) - 1  # what the count itself adds
        groups: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        for t in self.named.values():
            if id(t) in self._viewing or t.numel() == 0 or type(t) not in (torch.Tensor, torch.nn.Parameter):
                continue
            try:
                key = (str(t.device), t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
            groups.setdefault(key, {})[id(t)] = t
        out: set[int] = set()
        for members in groups.values():
            first = next(iter(members.values()))
            if _storage_users(first) != len(members) + extra:
                continue  # an alias outside the named tensors: copy, so it sees the new bytes
            spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.is_contiguous())
                           for t in members.values())
            if all(c for _, _, c in spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])):
                out.update(members)
        return out

    @property
    def viewing(self) -> int:
        """How many of the model's tensors are views of received buffers now."""
        return len(self._viewing)

    def stats(self) -> dict[str, int]:
        """Loads done, bytes taken as views (not copied) and bytes copied, over all loads."""
        return dict(self._stats)


def _pack_and_digest(buffer: torch.Tensor, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> str | None:
    """Copy ``tensors`` into a CPU ``buffer`` at their offsets, zero the padding, and digest it, span by span.

    Each digest span is filled and hashed by one task on :func:`digest_pool`
    while its bytes are still in cache: one pass over memory instead of a
    copy pass and a hash pass, and no torch intra-op split to stall. None
    (nothing written) when a tensor or the buffer is not a contiguous CPU
    tensor: the caller packs with ``copy_`` then.
    """
    dst = _host_view(buffer)
    if dst is None:
        return None
    pieces = []
    for meta, t in zip(metas, tensors, strict=True):
        if meta.nbytes:
            src = _host_view(t)
            if src is None:
                return None
            pieces.append((meta.offset, meta.offset + meta.nbytes, src))
    starts = [a for a, _, _ in pieces]

    def fill_and_hash(span: tuple[int, int]) -> bytes:
        a, b = span
        pos = a
        for start, end, src in pieces[max(bisect.bisect_right(starts, a) - 1, 0):]:
            if start >= b:
                break
            lo, hi = max(a, start), min(b, end)
            if hi <= lo:
                continue
            if lo > pos:
                dst[pos:lo] = 0
            np.copyto(dst[lo:hi], src[lo - start : hi - start])
            pos = hi
        if b > pos:
            dst[pos:b] = 0
        return digest_leaf(dst[a:b])

    spans = digest_spans(dst.size)
    leaves = [fill_and_hash(spans[0])] if len(spans) == 1 else list(digest_pool().map(fill_and_hash, spans))
    torch.autograd.graph.increment_version(buffer)  # written through numpy: tell torch, as copy_ would
    return digest_root(dst.size, leaves)


def weight_digest(buffer: torch.Tensor) -> str:
    """The digest of a weight buffer (CPU or device; device buffers are copied to the host first): 32 hex chars."""
    return weight_digests([buffer])[0]


buffer_checksum = weight_digest  #: the name this function had before; same function


def verify_buckets(buckets: Sequence[WeightBucket], *, where: str | None = None,
                   digests: Sequence[str] | None = None) -> None:
    """Check every bucket against its checksum, in parallel; the first mismatch is a ``WeightTransferError``.

    Buckets this object already verified (buffer unchanged since) are not
    hashed again; ``where`` says where the bytes were read, for the message.
    ``digests``: the buffers' digests when the caller computed them while
    copying the bytes in (with :func:`digest_leaf` / :func:`digest_root`).
    """
    if digests is not None:
        todo = list(buckets)
        if len(digests) != len(todo):
            raise ValueError(f"{len(digests)} digests for {len(todo)} buckets")
    else:
        todo = [b for b in buckets if not b.verified]
        if not todo:
            return
        digests = weight_digests([b.buffer for b in todo])
    for bucket, actual in zip(todo, digests, strict=True):
        if actual != bucket.checksum:
            place = f" ({where})" if where else ""
            raise WeightTransferError(
                f"weight bucket {bucket.index} of version {bucket.version} is corrupted{place}: checksum {actual} "
                f"!= {bucket.checksum} sent; the version was not applied"
            )
    for bucket in todo:
        bucket._mark_verified()


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> Iterator[WeightBucket]:
    """Pack ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Tensors
    are copied once, straight into the bucket buffer (a non-contiguous one
    too, without a contiguous copy first), in the order given; only the
    alignment padding between them is zeroed. On the host each digest span
    of the buffer is filled and hashed by one task on the digest threads
    (one pass over the bytes); device or non-contiguous tensors are copied
    with ``copy_`` and then hashed. ``allocate(nbytes)``, when
    given, returns the 1-D uint8 buffer of a bucket (e.g. a view of a
    shared-memory segment, so the export needs no further copy to cross a
    process boundary); by default a fresh tensor on the first tensor's
    device. The bucket's digest is taken when it is full, and the bucket
    counts as verified (:attr:`WeightBucket.verified`) until its buffer is
    written in place through torch.
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
        if allocate is None:
            buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        else:
            buffer = allocate(offset)
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != offset:
                raise ValueError(f"allocate({offset}) must return a 1-D uint8 tensor of {offset} bytes, got "
                                 f"{buffer.dtype} of shape {tuple(buffer.shape)}")
        checksum = _pack_and_digest(buffer, metas, [t for _, t in pending])
        if checksum is None:  # a device or non-contiguous tensor: torch copies, then one digest pass
            end = 0
            with torch.no_grad():
                for meta, (_, t) in zip(metas, pending, strict=True):
                    if meta.offset > end:
                        buffer[end : meta.offset].zero_()
                    dst = buffer[meta.offset : meta.offset + meta.nbytes]
                    if meta.nbytes:
                        dst.view(t.dtype).view(t.shape).copy_(t.detach())
                    end = meta.offset + meta.nbytes
                if offset > end:
                    buffer[end:offset].zero_()
            checksum = weight_digest(buffer)
        bucket = WeightBucket(version, index, tuple(metas), buffer, checksum, last)
        # the checksum was just taken from this buffer: a receiver of this object (same process) need not rehash
        # it until torch sees an in-place write (the version counter; docs/weight-transports.md, "Verification")
        bucket._mark_verified()
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


def _storage_users(buffer: torch.Tensor) -> int | None:
    """How many tensors (views included) use ``buffer``'s storage; None when this torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(buffer.untyped_storage()._cdata))


class _Slot:
    """One version's buffers in an :class:`ExportArena`, with the storage users the arena itself accounts for."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.own: list[int] = []
        self.claim: Callable[[], object] | None = None  #: weak reference to the allocate function filling it

    def free(self) -> bool:
        """True when no allocate function is filling the slot and nothing outside the arena uses a buffer of it."""
        if self.claim is not None and self.claim() is not None:
            return False
        for buffer, own in zip(self.buffers, self.own, strict=True):
            users = _storage_users(buffer)
            if users is None or users > own:
                return False
        return True


class ExportArena:
    """Buffers for weight versions kept across versions: reused once nothing holds the version they carried.

    Pass ``allocate=arena.allocator()`` to :func:`pack_buckets` for each
    version (a receiver takes its copy's buffer the same way). Each call to
    :meth:`allocator` picks a *slot* (one version's buffers) that is free:
    no allocate function still refers to it (``pack_buckets`` holds its
    ``allocate`` until the last bucket is packed), and none of its buffers is
    used by anything outside the arena: a bucket, a view from
    :meth:`WeightBucket.tensors`, a numpy array or memoryview of it. The
    check is the storage's use count, so a receiver that still holds any
    part of a version keeps its slot from being rewritten, with no call to
    make when it is done. A version staged by a transport is held, so a
    trainer exporting the next version gets the other slot (double
    buffering); a slot is made when none is free, up to ``max_slots`` (a
    third covers a receiver still reading the version before the staged
    one), and past that a version gets fresh buffers the arena does not
    keep (counted in :meth:`stats` as ``fresh_versions``).

    Why: a fresh buffer of tens of MiB is new pages from the OS, and
    writing it page-faults every page; a kept buffer's pages are already
    mapped (docs/performance.md, "Weight sync"). The price: the kept slots
    stay allocated (:meth:`stats`' ``kept_bytes``) until the arena goes.
    The contract is for host memory, and for device memory used on one
    stream: a write into a reused buffer is ordered after reads already
    issued on the same stream, while reads in flight on another stream are
    not seen by the use count. Thread-safe. When this torch cannot report a
    storage's use count, every version gets fresh buffers (never an unsafe
    reuse).
    """

    def __init__(self, *, max_slots: int = 3, device: torch.device | str = "cpu") -> None:
        if max_slots < 2:
            raise ValueError(f"an export arena needs max_slots >= 2 (double-buffered), got {max_slots}")
        self.max_slots = max_slots
        self.device = torch.device(device)
        self._can_count = _storage_users(torch.empty(0)) is not None
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._stats = {"versions": 0, "reused_bytes": 0, "allocated_bytes": 0, "fresh_versions": 0}

    def allocator(self) -> Callable[[int], torch.Tensor]:
        """``allocate(nbytes)`` for one version's buckets, in order: 1-D uint8 buffers of a free slot."""
        index = 0
        slot: _Slot | None = None

        def allocate(nbytes: int) -> torch.Tensor:
            nonlocal index
            i, index = index, index + 1
            assert slot is not None
            with self._lock:
                if i < len(slot.buffers) and slot.buffers[i].numel() >= nbytes:
                    self._stats["reused_bytes"] += nbytes
                else:
                    self._stats["allocated_bytes"] += nbytes
                    buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    own = _storage_users(buffer)
                    assert own is not None
                    if i < len(slot.buffers):
                        slot.buffers[i], slot.own[i] = buffer, own
                    else:
                        slot.buffers.append(buffer)
                        slot.own.append(own)
                return slot.buffers[i][:nbytes]

        with self._lock:
            self._stats["versions"] += 1
            slot = next((s for s in self._slots if s.free()), None)
            if slot is None and len(self._slots) < self.max_slots and self._can_count:
                slot = _Slot()
                self._slots.append(slot)
            if slot is None:
                self._stats["fresh_versions"] += 1
                return self._fresh
            slot.claim = weakref.ref(allocate)
        return allocate

    def _fresh(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._stats["allocated_bytes"] += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def stats(self) -> dict[str, int]:
        """Versions handed out, bytes reused and newly allocated, versions that got unkept fresh buffers, slots."""
        with self._lock:
            return {**self._stats, "slots": len(self._slots),
                    "kept_bytes": sum(b.numel() for s in self._slots for b in s.buffers)}


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
                         model: ModelTensors | None = None,
                         partial: Collection[str] | None = None) -> list[WeightBucket]:
    """Every bucket of the update to ``version``, checked before anything of it is applied.

    The checks a rollout engine owes the weight-update contract (a refused
    update changes nothing): each bucket's checksum; every bucket of
    ``version``; no tensor sent twice; a final bucket marked ``last``; and,
    with ``model``, every name known with the model's shape and dtype and
    every tensor of the model covered. Raises :class:`WeightTransferError`
    saying which check failed.

    ``partial`` declares an update that sets only some tensors (an adapter
    set: a LoRA adapter's tensors, or only the modules it targets): the
    names it carries. Then every declared tensor must arrive and nothing
    else may; the model's other tensors keep their values. Without the
    declaration an update that leaves a tensor of ``model`` unset is refused.
    """
    declared: set[str] | None = None
    if partial is not None:
        if isinstance(partial, (str, bytes, bool)):
            raise TypeError("partial takes the names of the tensors the update carries (a collection of str), "
                            f"got {partial!r}")
        declared = set(partial)
        if not declared:
            raise WeightTransferError(f"the partial update to version {version} declares no tensors")
        if model is not None:
            unknown = sorted(n for n in declared if n not in model.specs)
            if unknown:
                raise WeightTransferError(f"the partial update to version {version} declares {unknown[:3]}, not "
                                          "tensors of this model")
    received = [bucket async for bucket in buckets]
    if not all(b.verified for b in received):  # free for buckets the transport already verified
        await asyncio.to_thread(verify_buckets, received)  # all at once, in parallel, off the event loop
    names: set[str] = set()
    for bucket in received:
        if bucket.version != version:
            raise WeightTransferError(
                f"bucket {bucket.index} belongs to version {bucket.version}, not to the update to version {version}"
            )
        for meta in bucket.metas:
            if model is not None:
                model.check(meta)
            if declared is not None and meta.name not in declared:
                raise WeightTransferError(f"{meta.name!r} is not one of the {len(declared)} tensors the partial "
                                          f"update to version {version} declares")
            if meta.name in names:
                raise WeightTransferError(f"{meta.name!r} was sent twice in the update to version {version}")
            names.add(meta.name)
    if not received:
        raise WeightTransferError(f"the update to version {version} carried no weight buckets")
    if not received[-1].last:
        raise WeightTransferError(f"the update to version {version} ended before its last bucket")
    if declared is not None:
        unset = model.missing(names) if model is not None else list(declared - names)
        missing = sorted(n for n in unset if n in declared)
        if missing:
            raise WeightTransferError(f"the partial update to version {version} left {len(missing)} of its "
                                      f"{len(declared)} declared tensors unset, e.g. {missing[:3]}")
    elif model is not None:
        missing = model.missing(names)
        if missing:
            raise WeightTransferError(
                f"the update to version {version} left {len(missing)} of the model's tensors unset, e.g. "
                f"{missing[:3]}; an update of only some tensors (an adapter set) must say so: "
                "collect_update(..., partial=names)"
            )
    return received


def _align(n: int) -> int:
    return (n + BUCKET_ALIGNMENT - 1) // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT
