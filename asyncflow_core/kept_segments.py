"""Shared-memory segments a writer keeps across versions: written under an exclusive ``flock``, read under a
shared one.

Two parts of asyncflow hand a weight version to another process through
segment files in ``/dev/shm`` and reuse those segments for later versions
(a fresh segment per version means fresh tmpfs pages, and the first write
to each page faults): a rank hands its buckets to its driver
(:class:`asyncflow_core.launchers.rank_worker.KeptSegments`) and the ``shm``
weight transport hands versions to its receivers
(``asyncflow_plugins/weight_transports/shm.py``). Both follow the discipline
this module implements once:

- the writer creates a segment (``O_EXCL``, mode ``0600``) holding its
  exclusive ``flock``, and rewrites a kept segment only after taking that
  lock again *without waiting* (:meth:`KeptSegment.try_lock`), which fails
  while any reader maps it, or when its name no longer names this file
  (someone unlinked it: no reader could open it by name any more);
- a reader maps a segment only under the shared lock, also taken without
  waiting (:func:`map_shared`): while the writer holds the exclusive lock it
  gets nothing and tries again later. ``mmap`` keeps a duplicate of the
  descriptor and the lock belongs to the open file, so the lock lasts
  exactly as long as the reader's mapping (every tensor or view of it), or
  until the reader's process dies. No message says "done";
- the writer unmaps a segment only when nothing of its own process still
  uses the memory (:meth:`KeptSegment.held_outside`, torch's storage use
  count), so buckets packed into it never dangle;
- before creating a segment the writer checks the file system has room
  (:func:`check_shm_room`): tmpfs grants any size at once and then kills
  the writer with ``SIGBUS`` on the first page past its limit;
- the writer's segments are named ``<prefix><pid>-<token>-<tag><n>``
  (:class:`SegmentKeeper`), unlinked when it closes, is garbage collected or
  its interpreter exits (a reader still mapping one keeps its pages), and
  those of a writer that was killed are removed by the next one
  (:func:`asyncflow_core.processes.sweep_dead`: the pid in the name is gone).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid
import weakref
from pathlib import Path

import torch

from asyncflow_core.types.weights import _storage_users

#: Where POSIX shared-memory segments appear as files (Linux)
SHM_DIR = Path("/dev/shm")


def shm_free_bytes(directory: Path) -> int | None:
    """Bytes free in the (shared-memory) file system at ``directory``; None when it cannot be asked."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_shm_room(directory: Path, nbytes: int, *, what: str = "a weight bucket",
                   error: type[Exception] = RuntimeError) -> None:
    """Refuse in one line (``error``) a segment of ``nbytes`` the file system at ``directory`` has no room for:
    tmpfs grants the size at once and then kills the writer with SIGBUS on the first page past its limit."""
    free = shm_free_bytes(directory)
    if free is not None and free < nbytes:
        raise error(
            f"{directory} has {free / 2**20:.0f} MiB free but {what} needs {nbytes / 2**20:.0f} MiB: "
            "give this host more shared memory (a container's default is often 64 MiB: docker run --shm-size=16g) "
            "or stop what fills it")


class KeptSegment:
    """A segment file this process created, mapped read-write, that it rewrites only under its exclusive lock.

    Created holding the exclusive lock (a new file: no reader can map it
    yet); :meth:`unlock` once its bytes are complete lets readers map it.
    """

    def __init__(self, path: Path, size: int) -> None:
        self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(self.fd, size)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.map: mmap.mmap | None = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        self.path = path
        self.size = size
        self.inode = os.fstat(self.fd).st_ino
        self.view: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)
        self._own = _storage_users(self.view)  # the users this object accounts for (its own view)

    def try_lock(self) -> bool:
        """Take the segment for writing, without waiting: fails while any reader maps it (its shared lock) and
        when its name no longer names this file (unlinked by someone else: readers could not open it).

        Taking it again while this object holds it succeeds (the lock belongs to this open file).
        """
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            named = os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            named = False
        if not named:
            self.unlock()
        return named

    def unlock(self) -> None:
        """The bytes are complete: readers may map the segment (they take the shared lock)."""
        with contextlib.suppress(OSError, ValueError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def held_outside(self) -> bool:
        """Whether anything of this process beside this object uses the mapping (buckets packed into it, views).

        ``False`` when torch cannot count (no ``_storage_Use_Count``): a writer that packs into segments must
        then not do so (the ``shm`` sender hands out fallback buffers only).
        """
        if self.view is None:
            return False
        users = _storage_users(self.view)
        return users is not None and self._own is not None and users > self._own

    def close(self) -> None:
        """Unmap (unless buckets of this process still use the mapping), drop the lock, unlink the name."""
        held = self.held_outside()
        self.view = None
        if not held and self.map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self.map.close()
        # else buckets packed into it still use the mapping: torch.frombuffer holds no buffer export that would
        # make close() refuse, so unmapping now would leave them dangling; their storage keeps the mmap object
        # alive and it unmaps when the last of them goes
        self.map = None
        self.unlock()  # the mapping's duplicate descriptor (if buckets keep it) shares the lock: drop it first
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def map_shared(fd: int, size: int, *, private: bool = False, writable: bool = True) -> mmap.mmap | None:
    """A reader's mapping of ``size`` bytes of segment ``fd``, under its shared lock; ``None`` while the writer
    holds the exclusive lock (it is writing: try again later).

    The mapping keeps a duplicate of ``fd``, and with it the lock, until it
    unmaps: the caller may close ``fd`` at once. ``private``: copy-on-write
    (a reader writing its pages never changes what others read); else
    shared, read-write unless ``writable`` is off.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    if private:
        return mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))


def _close_all(segments: list[KeptSegment]) -> None:
    for segment in segments:
        segment.close()
    segments.clear()


class SegmentKeeper:
    """The kept segments of one writer: their names, the room check, and their unlinking at the end.

    Names are ``<prefix><pid>-<token>-<tag><n>`` in ``directory``: the pid
    tells the next writer whether this one is gone (sweep them with
    :func:`asyncflow_core.processes.sweep_dead`), the token tells two
    writers of one process apart. :meth:`close` (or garbage collection, or
    the interpreter's exit) closes every segment still kept.
    """

    def __init__(self, directory: Path, prefix: str) -> None:
        self.dir = Path(directory)
        self.prefix = prefix
        self.token = uuid.uuid4().hex[:12]
        self._count = 0
        self._all: list[KeptSegment] = []
        self._finalizer = weakref.finalize(self, _close_all, self._all)

    def name(self, *, prefix: str | None = None, tag: str = "") -> Path:
        """A new segment path of this writer (``prefix``: another family of its names, e.g. unkept ones)."""
        self._count += 1
        return self.dir / f"{self.prefix if prefix is None else prefix}{os.getpid()}-{self.token}-{tag}{self._count}"

    def create(self, size: int, *, tag: str = "", what: str = "a weight bucket",
               error: type[Exception] = RuntimeError, kind: type[KeptSegment] = KeptSegment) -> KeptSegment:
        """A new kept segment of ``size`` bytes (a ``kind``), holding its exclusive lock; refused in one line
        (``error``) when the file system has no room for it."""
        check_shm_room(self.dir, size, what=what, error=error)
        segment = kind(self.name(tag=tag), size)
        self._all.append(segment)
        return segment

    def drop(self, segment: KeptSegment) -> None:
        """Stop keeping ``segment``: close it (a reader mapping it keeps its pages; the name goes)."""
        with contextlib.suppress(ValueError):
            self._all.remove(segment)
        segment.close()

    def __len__(self) -> int:
        return len(self._all)

    def close(self) -> None:
        self._finalizer()


__all__ = ["SHM_DIR", "KeptSegment", "SegmentKeeper", "check_shm_room", "map_shared", "shm_free_bytes"]
