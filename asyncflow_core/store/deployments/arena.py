"""A shared-memory arena: one tmpfs file every process of a store maps once.

Why one long-lived arena rather than a segment per put: a fresh shared
memory page costs a page fault (and zeroing) on first touch in every process
that maps it, which on common hosts caps a copy into fresh memory at 1-2 GB/s,
a fifth of a warm ``memcpy``. Recycling ranges of one arena that every client
keeps mapped means a put is one warm copy and a read needs no copy at all.

The server owns the allocator (:class:`ArenaAllocator`); clients only map the
file (:class:`ArenaMapping`). The file sits in the store's private directory
(0700) and is itself 0600.
"""

from __future__ import annotations

import bisect
import mmap
import os

import torch

ALIGN = 64  # cache-line alignment keeps vectorised copies at full speed


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def create_arena_file(path: str, nbytes: int) -> None:
    """Create the arena file (0600, exclusive) with ``nbytes`` of (lazily allocated) space."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


class ArenaMapping:
    """A process's shared mapping of the arena, as a flat uint8 tensor (``bytes``)."""

    def __init__(self, path: str, nbytes: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.view = memoryview(self._mmap)
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes ``[offset, offset + nbytes)`` as a uint8 view sharing the arena's storage."""
        return self.bytes[offset : offset + nbytes]

    def owned_view(self, offset: int, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A uint8 tensor over a range with its *own* storage, plus the memoryview that storage keeps alive.

        torch keeps the memoryview referenced until the last tensor view of
        that storage dies, so a ``weakref.finalize`` on the memoryview tells
        exactly when a reader stopped using the range (see the client's pins).
        """
        mv = self.view[offset : offset + nbytes]
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), mv
        return torch.frombuffer(mv, dtype=torch.uint8), mv


class ArenaFullError(Exception):
    """Not enough contiguous free space in the arena right now."""


class ArenaAllocator:
    """First-fit allocator over ``[0, nbytes)`` with coalescing of freed ranges."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._starts: list[int] = [0] if nbytes else []  # sorted starts of free ranges
        self._sizes: dict[int, int] = {0: nbytes} if nbytes else {}
        self.used = 0

    def alloc(self, nbytes: int) -> int:
        """Offset of a new range of at least ``nbytes``; raises :class:`ArenaFullError` when none fits."""
        size = _round_up(max(nbytes, 1))
        for i, start in enumerate(self._starts):
            free = self._sizes[start]
            if free >= size:
                del self._starts[i]
                del self._sizes[start]
                if free > size:
                    self._starts.insert(i, start + size)
                    self._sizes[start + size] = free - size
                self.used += size
                return start
        raise ArenaFullError(f"no free range of {size} bytes ({self.nbytes - self.used} bytes free, fragmented)")

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range from :meth:`alloc` (same ``nbytes``)."""
        size = _round_up(max(nbytes, 1))
        self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        # merge with the following free range
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # merge with the preceding free range
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:
            prev = self._starts[i - 1]
            self._sizes[prev] += size
            return
        self._starts.insert(i, offset)
        self._sizes[offset] = size
