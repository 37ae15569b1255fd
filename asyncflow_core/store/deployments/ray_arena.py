"""The ray deployment's same-node data path: producer arenas in shared memory, beside Ray's object store.

Why: a ``ray.put`` maps a fresh object, and every one of its 4 KiB pages
costs a page fault in the producer (measured: 4,100 faults and 8-11 ms for a
16 MB put on the development host, where a warm copy of the same bytes takes
about 1.5 ms). A producer arena is a set of tmpfs files (fully allocated with
``posix_fallocate`` at creation, so a full ``/dev/shm`` is an error at
creation, never a ``SIGBUS`` later) that the producer keeps mapped and
recycles, so a put is one warm copy.

- **Writer** (:class:`ProducerArena`, one per store handle that puts): only
  the producer allocates ranges in its own files, so no allocation crosses a
  process. A range is ``[header | values...]``; the header holds the put's
  sequence number, written before the values.
- **Freeing**: the controller indexes a put's range like any object; when no
  row uses it any more it queues the range for that arena, and the producer's
  next put reply carries the queued ranges back (:meth:`ProducerArena.free`).
  A producer that exited leaves its files in place until the store closes,
  and so does a reader that exits holding a pin.
- **Readers** on the range's node map the file once and get **views** of
  it, no copy. The controller pins a range for each ``locate`` that names
  it; the reader's handle unpins it once no tensor over the range is left
  (a ``weakref.finalize`` on the range's memoryview, sent with the handle's
  next call), and a range is recycled only when no row uses it and no pin
  holds it. So a batch keeps its values for as long as it is referenced, as
  with Ray's objects. A reader also checks the header still holds the put's
  sequence number (a guard: a mismatch makes the get locate the rows again).
  Readers on another node ask the storage unit on the range's node
  (:func:`read_range`), which copies the values into its reply.
- **Rows outlive the producer**: the files are not tied to the producer's
  process; the creating handle's ``close`` removes the store's arena
  directory on every unit's node. The directory is named after the storage
  unit on its node (``asyncflow-ray-<unit pid>-<store>``), and a unit starting
  on a host removes those whose unit is gone (``processes.sweep_dead``), so a
  store whose processes were killed leaves no shared memory behind for longer
  than the next store's start.

A producer uses its arena only when a storage unit runs on its own node (so a
reader elsewhere has a unit to ask) and ``/dev/shm`` exists; otherwise, and
when its arena is at :data:`ARENA_MAX_BYTES`, a put goes through Ray's object
store as before.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import shutil
import uuid
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from asyncflow_core.processes import sweep_dead
from asyncflow_core.store.deployments.arena import ALIGN, ArenaAllocator, ArenaFullError, ArenaMapping

SHM_ROOT = "/dev/shm"
ARENA_MAX_BYTES = 1 << 30  #: per producer handle; puts beyond it go through Ray's object store (0: never use arenas)
ARENA_FILE_MIN_BYTES = 64 << 20  #: a new arena file holds at least this, or two puts of the size that needed it
HEADER = ALIGN  #: bytes before a range's values: the put's sequence number (int64), padded to the alignment


class RangeRecycledError(Exception):
    """A range was recycled while it was read: read again at the controller's current locations."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_DIR_PATTERN = re.compile(r"asyncflow-ray-(\d+)-")


def store_dir(store_key: str, unit_pid: int) -> str:
    """The directory (0700) holding a store's arena files on a node, named after that node's storage unit."""
    return os.path.join(SHM_ROOT, f"asyncflow-ray-{unit_pid}-{store_key}")


def remove_store_dir(store_key: str, unit_pid: int) -> None:
    shutil.rmtree(store_dir(store_key, unit_pid), ignore_errors=True)


def sweep_dead_arenas() -> list[str]:
    """Remove this user's arena directories whose storage unit is gone (its store's processes were killed)."""
    return sweep_dead(SHM_ROOT, _DIR_PATTERN, directories=True)


class ProducerArena:
    """A store handle's arena files, their allocators, and the copy of a put's columns into one range."""

    def __init__(self, store_key: str, node: str, unit: int, unit_pid: int) -> None:
        self.id = uuid.uuid4().hex
        self.node, self.unit = node, unit
        self.dir = store_dir(store_key, unit_pid)
        self.files: list[tuple[str, ArenaMapping, ArenaAllocator]] = []
        self._seq = itertools.count(1)
        self._failed = False  # a new file could not be made (/dev/shm full or missing): make no more

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for _, m, _ in self.files)

    def place(self, wire: dict[str, dict[str, tuple[np.ndarray, Any, Any]]]) -> dict[str, Any] | None:
        """A new range for a put's wire columns (allocated, not yet written: :meth:`fill`), or None when the arena
        is full. Allocation happens on the caller's thread only."""
        parts, size = {}, HEADER
        for name, col in wire.items():
            parts[name] = {}
            for key, (arr, dtype, shape) in col.items():
                parts[name][key] = (size, arr.dtype.str, tuple(arr.shape), dtype, tuple(shape))
                size += _aligned(arr.nbytes)
        place = self._alloc(size)
        if place is None:
            return None
        file_no, offset = place
        return {"arena": self.id, "node": self.node, "unit": self.unit, "path": self.files[file_no][0],
                "file": file_no, "offset": offset, "nbytes": size, "seq": next(self._seq), "parts": parts}

    def fill(self, desc: dict[str, Any], wire: dict[str, dict[str, tuple[np.ndarray, Any, Any]]]) -> None:
        """Copy the columns into the range :meth:`place` gave (the header first: see :meth:`ArenaReader.read`)."""
        data = self.files[desc["file"]][1].bytes.numpy()
        offset = desc["offset"]
        data[offset : offset + 8].view(np.int64)[0] = desc["seq"]
        for name, col in wire.items():
            for key, (arr, _, _) in col.items():
                if arr.nbytes:  # one memcpy (numpy's copy is single-threaded: no thread pool to wake on a busy host)
                    at = offset + desc["parts"][name][key][0]
                    np.copyto(data[at : at + arr.nbytes], arr.reshape(-1).view(np.uint8))

    def free(self, ranges: list[tuple[int, int, int]]) -> None:
        """Return ``(file, offset, nbytes)`` ranges the controller no longer indexes."""
        for file_no, offset, nbytes in ranges:
            if file_no < len(self.files):  # (none once closed: a put that was in flight then)
                self.files[file_no][2].free(offset, nbytes)

    def release(self, desc: dict[str, Any]) -> None:
        """Free a range the controller never indexed (its put failed)."""
        self.free([(desc["file"], desc["offset"], desc["nbytes"])])

    def close(self) -> None:
        self.files.clear()  # the mappings go with their last reference; the files stay for the store's readers

    def _alloc(self, size: int) -> tuple[int, int] | None:
        for i, (_, _, alloc) in enumerate(self.files):
            try:
                return i, alloc.alloc(size)
            except ArenaFullError:
                continue
        if self._failed:
            return None
        want = max(ARENA_FILE_MIN_BYTES, 2 * _aligned(size))
        if self.nbytes + want > ARENA_MAX_BYTES:
            want = _aligned(size)
            if self.nbytes + want > ARENA_MAX_BYTES:
                return None
        path = os.path.join(self.dir, f"{self.id}-{len(self.files)}")
        try:
            try:
                os.mkdir(self.dir, 0o700)  # never SHM_ROOT itself: no /dev/shm, no arena
            except FileExistsError:
                pass
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, want)  # ENOSPC now rather than SIGBUS on a later write
            finally:
                os.close(fd)
        except OSError as exc:
            try:
                os.unlink(path)
            except OSError:
                pass
            self._failed = True  # said once; the arena keeps the files it has
            warnings.warn(f"ray store: no shared-memory arena ({exc}); puts go through Ray's object store",
                          RuntimeWarning, stacklevel=3)
            return None
        self.files.append((path, ArenaMapping(path, want), ArenaAllocator(want)))
        return len(self.files) - 1, self.files[-1][2].alloc(size)


class ArenaReader:
    """A process's mappings of the arena files it read from (each mapped once, kept until :meth:`close`)."""

    def __init__(self) -> None:
        self._maps: dict[str, ArenaMapping] = {}

    def read(self, desc: dict[str, Any], names: list[str] | None = None,
             on_release: Any = None) -> dict[str, dict[str, torch.Tensor]]:
        """The range's columns (``names``, default all) as tensors over the mapped file, no copy
        (``{column: {"v": values, "o": offsets}}``). ``on_release()`` runs once no tensor over the range is left
        (the controller keeps the range from being recycled until then). :class:`RangeRecycledError` when the
        range no longer holds the put it describes."""
        path = desc["path"]
        mapping = self._maps.get(path)
        if mapping is None:
            try:
                mapping = self._maps[path] = ArenaMapping(path, os.stat(path).st_size)
            except FileNotFoundError:
                raise RangeRecycledError(path) from None  # the store closed meanwhile
        base = desc["offset"]
        if int(mapping.bytes[base : base + 8].view(torch.int64)[0]) != desc["seq"]:
            raise RangeRecycledError(path)
        whole = mapping.view[base : base + desc["nbytes"]]  # every tensor below keeps it referenced
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, col in desc["parts"].items():
            if names is not None and name not in names:
                continue
            out[name] = {}
            for key, (rel, np_dtype, np_shape, dtype, shape) in col.items():
                tdtype = _torch_dtype(np_dtype)
                count = int(np.prod(np_shape, dtype=np.int64))
                t = torch.frombuffer(whole, dtype=tdtype, count=count, offset=rel) if count else \
                    torch.empty(0, dtype=tdtype)
                t = t.reshape(np_shape)
                if dtype is not None:
                    t = t.view(getattr(torch, dtype)).reshape(shape)
                out[name][key] = t
        if on_release is not None:
            weakref.finalize(whole, on_release)
        return out

    def close(self) -> None:
        self._maps.clear()


_TORCH_DTYPES: dict[str, torch.dtype] = {}


def _torch_dtype(np_dtype: str) -> torch.dtype:
    t = _TORCH_DTYPES.get(np_dtype)
    if t is None:
        t = _TORCH_DTYPES[np_dtype] = torch.from_numpy(np.empty(0, dtype=np.dtype(np_dtype))).dtype
    return t


def read_range(reader: ArenaReader, desc: dict[str, Any],
               names: list[str] | None = None) -> dict[str, dict[str, tuple[np.ndarray, str, tuple[int, ...]]]]:
    """:meth:`ArenaReader.read` as wire columns (raw bytes, dtype, shape), for a storage unit's reply elsewhere."""
    cols = reader.read(desc, names)
    return {name: {k: (_as_numpy(t.clone()), str(t.dtype).removeprefix("torch."), tuple(t.shape))
                   for k, t in col.items()} for name, col in cols.items()}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


class Epoch:
    """A counter in shared memory: the controller publishes how often a stored value was replaced or freed, so a
    reader on its node can tell, without asking, whether locations it was given are still current.

    The writer (``create=True``) makes ``<directory>/epoch`` (the store's directory named after the writer's pid,
    removed by :meth:`remove`, or swept once that process is gone); readers map it read-only."""

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        if create:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, 8)
            finally:
                os.close(fd)
        fd = os.open(path, os.O_RDWR if create else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._mmap = mmap.mmap(fd, 8, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        self._value = np.frombuffer(self._mmap, dtype=np.int64)

    @property
    def value(self) -> int:
        return int(self._value[0])

    def set(self, value: int) -> None:
        self._value[0] = value

    def remove(self) -> None:
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)
