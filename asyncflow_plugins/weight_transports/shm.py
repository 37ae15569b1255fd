"""``shm`` weight transport: a version staged in a shared-memory segment, mapped by local processes.

Process model. One sender (the trainer) and any number of receivers on the
same host open the transport with the same ``name``. They share nothing but
files under ``directory`` (``/dev/shm``, i.e. RAM):

- ``asyncflow-wt-<name>.json`` — the manifest of the newest version
  (replaced atomically with ``os.replace``): tensor names, dtypes, shapes,
  offsets, checksums, the version, and which segment holds it. JSON, never
  pickle: a receiver executes nothing it reads.
- ``asyncflow-wt-<name>-<pid>-<token>-<slot>`` — two segments (slots A and B)
  the sender writes versions into, alternately: version v+1 goes to the slot
  that does not hold v, so a receiver reading v is not clobbered by v+1.
  Each segment starts with a 64-byte header (generation, state, version).

Who may write a segment is a file lock (``flock``), as for the rank
segments (both use :mod:`asyncflow_core.kept_segments`):
the sender writes a segment only while it holds the exclusive lock, taken
without waiting, and a receiver reads one only under a shared lock. A
receiver that maps a version keeps its shared lock for as long as the
mapping lives (``mmap`` holds a duplicate of the descriptor, and the lock
belongs to the open file), i.e. until the engine drops the last bucket or
view of it, or its process dies; meanwhile the sender puts new versions
into the other slot or a fresh segment, never into that one.

The sender can also have a version packed straight into the slot its next
send writes (:meth:`ShmWeightTransport.allocator`, passed to
``pack_buckets(..., allocate=)``): ``send`` then finds the buckets already in
place and only publishes them, with no copy.

Receivers take the shared lock, check the header's generation, map the
segment (private, copy-on-write: a receiver writing its buffers never
changes what others read) and hash it in place, span by span on the digest
threads; every bucket's digest is compared before any is yielded, and the
buckets yielded are views of the mapping (no copy). A receiver keeps its
mapping of each slot across versions (:class:`_Mapping`: no page faults or
unmapping per version) and takes the shared lock per version, dropped when
that version's last tensor goes. With ``reuse_buffers``
off a receiver copies the payload into fresh memory instead (hashing each
span right after copying it) and holds no lock once it returns. The
sender unlinks its segments and the manifest on ``close()`` (and, as a
fallback, when the object is garbage collected or the process exits);
segments left by a sender that was killed are removed by the next sender on
the same directory (their pid, in the name, is dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import re
import struct
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import TransferReport, TransportFeatures, WeightTransport, check_whole_version
from asyncflow_core.kept_segments import KeptSegment, SegmentKeeper, map_shared
from asyncflow_core.processes import pid_alive, sweep_dead
from asyncflow_core.types import WeightBucket
from asyncflow_core.types.weights import (
    _storage_users,
    digest_leaf,
    digest_pool,
    digest_root,
    digest_spans,
    verify_buckets,
)
from asyncflow_plugins.weight_transports.config import ShmTransportConfig
from asyncflow_plugins.weight_transports.manifest import (
    VersionManifest,
    align,
    buckets_from_payload,
    copy_into,
    manifest_for,
    parse_manifest,
)

FEATURES = TransportFeatures(cross_process=True, cross_host=False, devices=("cpu",))
PREFIX = "asyncflow-wt-"
HEADER = struct.Struct("<4sQQQ")  # magic, generation, state, version
HEADER_BYTES = 64
MAGIC = b"AFWT"
WRITING, READY = 0, 1
MAPPINGS_KEPT = 2  #: segments a receiver keeps mapped across versions (the sender's two slots)

_SEGMENT = re.compile(r"^asyncflow-wt-[A-Za-z0-9_.]{1,64}-(\d+)-[0-9a-f]{12}-[ab]\d+$")


class ShmManifest(BaseModel):
    """The manifest file: the weights' manifest plus where the sender staged them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    segment: str = Field(description="File name (in the transport's directory) of the segment holding the payload.")
    generation: int = Field(ge=1, description="Write generation of the segment when this version was published.")
    owner_pid: int = Field(description="Process id of the sender.")
    owner_token: str = Field(description="Random id of the sender object (two senders on one name are refused).")
    weights: VersionManifest = Field(description="Tensor layout and checksums of the version.")


class _Segment(KeptSegment):
    """A sender-owned segment (a slot's), with the 64-byte header receivers check against the manifest."""

    def __init__(self, path: Path, size: int) -> None:
        super().__init__(path, size)
        #: the generation an allocator set when it began packing a version into this segment, else None
        self.packing: int | None = None

    def set_header(self, generation: int, state: int, version: int) -> None:
        assert self.map is not None
        HEADER.pack_into(self.map, 0, MAGIC, generation, state, version)

    def place(self, buffer: torch.Tensor) -> int | None:
        """The payload offset of ``buffer`` when it lies in this segment's payload, else None."""
        if (self.view is None or buffer.device.type != "cpu"
                or buffer.untyped_storage().data_ptr() != self.view.untyped_storage().data_ptr()):
            return None
        return buffer.data_ptr() - self.view.data_ptr() - HEADER_BYTES

    def close(self) -> None:
        self.packing = None
        super().close()


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


class _Mapping:
    """A receiver's private mapping of one segment, kept across the versions the sender writes into it.

    The page tables of a 2 GB mapping take a fault per 64 KiB to build and a
    pass to tear down; a kept mapping pays that once per segment instead of
    once per version. Its shared lock is taken per version (:meth:`lock`) and
    dropped when the last tensor of that version goes (:meth:`_released`,
    a finalizer on the array the version's tensors are made from), so the
    sender may rewrite the segment exactly when nothing of the receiver uses
    its bytes; the mapping (unlocked) stays for the next version in it.
    """

    def __init__(self, path: Path, fd: int, inode: int, size: int) -> None:
        self.path = path
        self.fd = fd  # kept open: the lock is taken and dropped on it (the mapping's duplicate shares it)
        self.inode = inode
        self.size = size
        self.map: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        self.busy = False  #: a reader reserved it, or a version lent from it is alive (holding the shared lock)
        self.closing = False  #: close when the version in use is released

    def lock(self) -> bool:
        """Take the shared lock for one version, without waiting; False while the sender writes the segment."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def named(self) -> bool:
        """Whether the segment's name still names this file (the sender unlinks a segment it replaces)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def lend(self, nbytes: int) -> torch.Tensor:
        """The payload (``nbytes`` after the header) as a tensor, for a reader that holds the reservation and the
        lock: both go when the tensor's last user (a view, a numpy array of it) does."""
        assert self.map is not None
        array = np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        weakref.finalize(array, _Mapping._released, self)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.from_numpy(array)

    def _released(self) -> None:
        self.unlock()  # first: a reader that sees ``busy`` off may lock at once
        self.busy = False
        if self.closing:
            self.close()

    def close(self) -> None:
        """Unmap and close now, or (while a version is in use) when it is released."""
        if self.busy:
            self.closing = True
            return
        mapped, self.map = self.map, None
        if mapped is not None:
            with contextlib.suppress(BufferError, ValueError):
                mapped.close()  # an export still being torn down: the object unmaps when it is collected
        self.unlock()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


class ShmWeightTransport(WeightTransport):
    """Stages versions in two shared-memory segments; receivers in any local process map and verify them."""

    def __init__(self, config: ShmTransportConfig | None = None) -> None:
        self.config = config or ShmTransportConfig()
        directory = Path(self.config.directory)
        self.dir = directory if directory.is_dir() else Path(tempfile.gettempdir())
        self.name = self.config.name or f"private.{uuid.uuid4().hex[:12]}"
        self.manifest_path = self.dir / f"{PREFIX}{self.name}.json"
        # the slots' segments: <PREFIX><name>-<pid>-<token>-<slot><n>, closed (unlinked) by close(), GC or exit
        self._keeper = SegmentKeeper(self.dir, f"{PREFIX}{self.name}-")
        self._token = self._keeper.token
        self._slots: dict[str, _Segment] = {}
        self._staged: ShmManifest | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._closed = False
        # reuse_buffers: a receiver maps the sender's kept segments (no copy); off: it copies into fresh memory
        self._map = self.config.reuse_buffers
        self._stats = {"in_place_bytes": 0, "copied_bytes": 0, "slots_held": 0}
        self._needed: int | None = None  # segment bytes the last staged version took: what allocator() lays out
        # a receiver's kept mappings, by segment name (at most MAPPINGS_KEPT, those whose name is gone dropped)
        self._mappings: dict[str, _Mapping] = {}
        self._mappings_lock = threading.Lock()
        # unlinks the manifest files this sender wrote if close() is never called (GC or interpreter exit)
        self._owned: list[Path] = []
        self._finalizer = weakref.finalize(self, _unlink_all, self._owned)

    @property
    def features(self) -> TransportFeatures:
        return FEATURES

    # ------------------------------------------------------------------ send

    def allocator(self, fallback: Callable[[int], torch.Tensor] | None = None) -> Callable[[int], torch.Tensor]:
        """``allocate(nbytes)`` for ``pack_buckets``: a version's buffers laid out in the slot the next send writes.

        Pack the next version with it and ``send`` finds the buckets already
        in place: it publishes them without copying. The slot is the one not
        holding the staged version (receivers may be mapping that one); the
        sender holds its exclusive lock and its header says "being written"
        from the first allocation on, so a receiver that read an older
        manifest naming it retries with the newest. When a receiver still
        maps the version in that slot, the slot gets a fresh segment instead
        (its bytes are never overwritten). A bucket gets ``fallback(nbytes)``
        (default: a fresh CPU buffer) and is copied in by ``send`` as before
        when the slot cannot take it: on the first version (the segment's
        size is learnt from the first send), when the version outgrew the
        last one, or when something in this process still holds buckets
        packed into that slot earlier. Buckets must be sent whole, in the
        order packed, and not written after packing (receivers map these
        very bytes).
        """
        self._check_open()
        fallback = fallback or (lambda n: torch.empty(n, dtype=torch.uint8))
        segment: _Segment | None = None
        generation: int | None = None
        started = False
        end = 0

        def allocate(nbytes: int) -> torch.Tensor:
            nonlocal segment, generation, started, end
            if not started:
                started = True
                segment, generation = self._begin_packing()
            offset = align(end)  # where manifest_for will put this bucket
            end = offset + nbytes
            with self._lock:
                # still ours: no send or other allocator replaced the segment or began packing into it since
                view = (segment.view if segment is not None and generation is not None
                        and segment.packing == generation and HEADER_BYTES + end <= segment.size else None)
                if view is not None:
                    return view[HEADER_BYTES + offset : HEADER_BYTES + end]
            return fallback(nbytes)

        return allocate

    def _begin_packing(self) -> tuple[_Segment | None, int | None]:
        """The segment a new version may be packed into (header set to "being written") and its packing mark."""
        with self._lock:
            if self._closed or self._needed is None or _storage_users(torch.empty(0)) is None:
                return None, None  # nothing staged yet (size unknown), or torch cannot tell us who holds a segment
            slot = self._free_slot()
            segment = self._slots.get(slot)
            if segment is None or segment.size < self._needed or segment.held_outside() or not self._lock_slot(segment):
                segment = self._new_segment(slot, self._needed)
            self._generation += 1
            segment.packing = self._generation
            segment.set_header(self._generation, WRITING, 0)
            return segment, self._generation

    def _lock_slot(self, segment: _Segment) -> bool:
        """Whether this sender may rewrite ``segment`` now (no receiver maps it); counts the times one did."""
        if segment.try_lock():
            return True
        self._stats["slots_held"] += 1
        return False

    def _free_slot(self) -> str:
        """The slot that does not hold the staged version (receivers may be mapping that one)."""
        current = self._staged.segment if self._staged else None
        holds_current = self._slots.get("a") is not None and self._slots["a"].path.name == current
        return "b" if holds_current else "a"

    def _new_segment(self, slot: str, size: int) -> _Segment:
        old = self._slots.pop(slot, None)
        if old is not None:
            self._keeper.drop(old)  # receivers mapping it, or buckets packed into it, keep their mapping; the name goes
        segment = self._keeper.create(size, tag=slot, what="a weight version", error=WeightTransferError, kind=_Segment)
        assert isinstance(segment, _Segment)
        self._slots[slot] = segment
        return segment

    async def send(self, buckets: AsyncIterable[WeightBucket], *, deadline_s: float) -> TransferReport:
        self._check_open()
        start = time.perf_counter()
        cancelled = threading.Event()
        try:
            async with asyncio.timeout(deadline_s):
                received = [b async for b in buckets]
                version = check_whole_version(received)
                self._check_newer(version)
                # the copy runs on a thread that a timeout cannot stop: it checks ``cancelled`` before publishing
                work = asyncio.ensure_future(asyncio.to_thread(self._stage, received, cancelled))
                work.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.shield(work)
        except TimeoutError:
            cancelled.set()
            raise WeightTransferError(
                f"staging a weight version in shared memory did not finish within its {deadline_s:g}s deadline; "
                "the previously staged version stays current"
            ) from None
        nbytes = sum(b.nbytes for b in received)
        return TransferReport(version=version, buckets=len(received), bytes=nbytes, seconds=time.perf_counter() - start)

    def _check_newer(self, version: int) -> None:
        if self._staged is not None and version <= self._staged.weights.version:
            raise WeightTransferError(
                f"version {version} is not newer than the staged version {self._staged.weights.version}; "
                "versions must increase"
            )

    def _stage(self, buckets: list[WeightBucket], cancelled: threading.Event) -> None:
        with self._lock:  # one writer at a time, even when a timed-out send is still copying
            if cancelled.is_set() or self._closed:
                raise WeightTransferError("staging was cancelled (deadline passed or transport closed)")
            weights = manifest_for(buckets)
            self._check_newer(weights.version)
            if not self._slots and self._staged is None:
                self._claim_name()
            slot = self._free_slot()
            segment = self._slots.get(slot)
            needed = HEADER_BYTES + weights.total_bytes
            placed = [segment.place(b.buffer) if segment is not None else None for b in buckets]
            in_place = [p is not None and p == e.offset for p, e in zip(placed, weights.buckets, strict=True)]
            packed_here = segment is not None and segment.packing is not None and any(in_place)
            if packed_here and any(p is not None and not ok for p, ok in zip(placed, in_place, strict=True)):
                packed_here = False  # some bucket lies in the slot but not where the manifest puts it: copy anew
            if (segment is None or segment.size < needed or (not packed_here and segment.held_outside())
                    or not self._lock_slot(segment)):  # packed here: this sender took the lock when packing began
                segment = self._new_segment(slot, needed)  # never overwrite bytes something still holds
                in_place = [False] * len(buckets)
            segment.packing = None
            self._generation += 1
            generation = self._generation
            segment.set_header(generation, WRITING, weights.version)
            copy = [(e, b) for e, b, ok in zip(weights.buckets, buckets, in_place, strict=True) if not ok]
            if copy:
                copy_into(segment.view[HEADER_BYTES : HEADER_BYTES + weights.total_bytes], weights, buckets,
                          only=[e.index for e, _ in copy])
            segment.set_header(generation, READY, weights.version)
            self._needed = needed
            self._stats["in_place_bytes"] += sum(e.nbytes for e, ok in zip(weights.buckets, in_place, strict=True)
                                                 if ok)
            self._stats["copied_bytes"] += sum(e.nbytes for e, _ in copy)
            if cancelled.is_set():
                raise WeightTransferError("staging was cancelled by its deadline")
            segment.unlock()  # complete: receivers may map it from now on
            manifest = ShmManifest(
                segment=segment.path.name,
                generation=generation,
                owner_pid=os.getpid(),
                owner_token=self._token,
                weights=weights,
            )
            tmp = self.dir / f"{PREFIX}{self.name}.json.{self._token}.tmp"
            if tmp not in self._owned:
                self._owned.append(tmp)
            tmp.write_text(manifest.model_dump_json())
            os.replace(tmp, self.manifest_path)  # receivers see the old manifest or the new one, never half of one
            if self.manifest_path not in self._owned:
                self._owned.append(self.manifest_path)
            self._staged = manifest

    def stats(self) -> dict[str, int]:
        """Bytes published in place (packed by :meth:`allocator`), bytes copied into a segment, and
        ``slots_held``: the times a slot was passed over because a receiver still mapped it (a new segment instead).
        """
        with self._lock:
            return dict(self._stats)

    def _claim_name(self) -> None:
        """First send: refuse a name another live sender uses; remove segments of dead senders."""
        if self.manifest_path.exists():
            try:
                other = ShmManifest.model_validate_json(self.manifest_path.read_bytes())
            except (ValueError, OSError):
                other = None
            if other is not None and other.owner_pid != os.getpid() and pid_alive(other.owner_pid):
                raise WeightTransferError(
                    f"shm transport name {self.name!r} is in use by sender pid {other.owner_pid}; "
                    "give each sender its own name"
                )
        sweep_dead(self.dir, _SEGMENT)  # any name's segments whose sender was killed (the pid in the name is gone)
        for path in self.dir.glob(f"{PREFIX}*.json"):  # and other names' manifests whose owner is gone
            if path == self.manifest_path:
                continue  # ours: replaced by this sender's first publish
            try:
                stale = not pid_alive(ShmManifest.model_validate_json(path.read_bytes()).owner_pid)
            except (ValueError, OSError):
                stale = False  # not ours to judge
            if stale:
                with contextlib.suppress(OSError):
                    path.unlink()

    # --------------------------------------------------------------- receive

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        self._check_open()
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        newest: int | None = None
        seen: tuple[int, int] | None = None
        manifest: ShmManifest | None = None
        while True:
            remaining = end - loop.time()
            if remaining <= 0:
                raise WeightTransferError(
                    f"no weight version >= {min_version} was staged in shared memory {self.name!r} within "
                    f"{deadline_s:g}s (newest staged: {'none' if newest is None else newest})"
                )
            stat = _stat(self.manifest_path)
            if stat is not None and stat != seen:
                seen = stat
                manifest = _read_manifest(self.manifest_path)
                if manifest is not None:
                    newest = manifest.weights.version
            if manifest is not None and manifest.weights.version >= min_version:
                # the buckets come back through a box emptied here, not as the thread's result: the executor's
                # future would keep them, and with them the mapping and its lock, alive after the engine drops them
                box: list[list[WeightBucket] | None] = []
                try:
                    async with asyncio.timeout(remaining):
                        await asyncio.to_thread(lambda m=manifest: box.append(self._read_version(m)))
                    buckets = box.pop()
                except TimeoutError:
                    raise WeightTransferError(
                        f"reading version {manifest.weights.version} out of shared memory took longer than the "
                        f"{deadline_s:g}s deadline"
                    ) from None
                if buckets is not None:
                    break
                seen = None  # the segment moved on under us: read the new manifest
                await asyncio.sleep(min(self.config.poll_interval_s, max(end - loop.time(), 0)))
                continue
            await asyncio.sleep(min(self.config.poll_interval_s, max(remaining, 0)))
        for bucket in buckets:
            yield bucket

    def _read_version(self, manifest: ShmManifest) -> list[WeightBucket] | None:
        """Map (or copy) and verify one version; ``None`` when the segment is being rewritten or is gone (retry)."""
        path = self.dir / manifest.segment
        if "/" in manifest.segment or not manifest.segment.startswith(PREFIX):
            raise WeightTransferError(f"the shm manifest names an unexpected segment {manifest.segment!r}")
        if self._map and manifest.weights.total_bytes > 0:
            kept = self._kept_mapping(path)
            if kept is not None:
                return self._read_kept(kept, manifest)
        opened = self._open_owned(path)
        if opened is None:
            return None
        fd, st = opened
        try:
            size = st.st_size
            self._check_size(manifest, size)
            # under the shared lock, which the mapping keeps (a duplicate of fd) until it unmaps
            mapped = map_shared(fd, size, private=self._map, writable=False)
        finally:
            os.close(fd)
        if mapped is None:
            return None  # the sender is writing it (a newer version than this manifest): read the new manifest
        try:
            current = self._header_matches(mapped, manifest)
        except BaseException:
            mapped.close()
            raise
        if not current:
            mapped.close()
            return None
        # (a version that fails its check leaves the mapping, and its lock, to the exception: gone with it)
        return self._map_out(mapped, manifest) if self._map else self._copy_out(mapped, manifest)

    def _kept_mapping(self, path: Path) -> _Mapping | None:
        """The kept mapping of the segment at ``path`` (made now if none is kept), reserved for one read (its
        ``busy`` set); None while a version this receiver holds from it is in use (then it maps it anew), or
        when there is no such file (the usual path reports it)."""
        with self._mappings_lock:
            for name, kept in list(self._mappings.items()):  # segments the sender replaced or removed: unmap
                if not kept.busy and not kept.named():
                    del self._mappings[name]
                    kept.close()
            kept = self._mappings.get(path.name)
            if kept is not None:
                if kept.busy:
                    return None
                kept.busy = True
                return kept
            opened = self._open_owned(path)
            if opened is None:
                return None
            fd, st = opened
            try:
                kept = _Mapping(path, fd, st.st_ino, st.st_size) if st.st_size > HEADER_BYTES else None
            except BaseException:
                os.close(fd)
                raise
            if kept is None:
                os.close(fd)
                return None
            if len(self._mappings) >= MAPPINGS_KEPT:  # keep the newest few: drop an idle one
                idle = next((n for n, m in self._mappings.items() if not m.busy), None)
                if idle is not None:
                    self._mappings.pop(idle).close()
            self._mappings[path.name] = kept
            kept.busy = True
            return kept

    def _read_kept(self, kept: _Mapping, manifest: ShmManifest, *, again: bool = True) -> list[WeightBucket] | None:
        """One version out of a kept mapping (reserved): shared lock, size and header, hash in place, views of
        it; ``None``: the sender is rewriting it, read the new manifest."""
        locked = lent = False
        try:
            if not kept.lock():
                return None  # the sender is writing it (a newer version than this manifest): read the new manifest
            locked = True
            self._check_size(manifest, min(os.fstat(kept.fd).st_size, kept.size))
            # the file's header, not the mapping's: a page this receiver wrote is its own copy (copy-on-write)
            if not self._header_matches(os.pread(kept.fd, HEADER.size, 0), manifest):
                return None
            payload = kept.lend(manifest.weights.total_bytes)  # the lock now goes with the payload's last user
            lent = True
        finally:
            if not lent:  # give the reservation (and the lock, if taken) back
                if locked:
                    kept.unlock()
                kept.busy = False
        try:
            return self._hash_in_place(manifest, payload)
        except WeightTransferError:
            if not again:
                raise
            # the bytes do not match: drop this mapping (pages of it written here would have been kept by
            # copy-on-write) and check once more through a fresh one; a real corruption fails there too
            payload = None
            with self._mappings_lock:
                if self._mappings.get(kept.path.name) is kept:
                    del self._mappings[kept.path.name]
            kept.close()  # now, or when the failed version's last view goes
            fresh = self._kept_mapping(kept.path)
            if fresh is None:
                raise
            return self._read_kept(fresh, manifest, again=False)

    @staticmethod
    def _open_owned(path: Path) -> tuple[int, os.stat_result] | None:
        """A read-only descriptor of the segment at ``path`` and its stat; None when there is no such file."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        if st.st_uid != os.getuid():  # /dev/shm is world-writable: never take weights another user planted
            os.close(fd)
            raise WeightTransferError(
                f"shared-memory segment {path.name} belongs to uid {st.st_uid}, not this user "
                f"({os.getuid()}); refusing it"
            )
        return fd, st

    @staticmethod
    def _check_size(manifest: ShmManifest, size: int) -> None:
        needed = HEADER_BYTES + manifest.weights.total_bytes
        if size < needed:
            raise WeightTransferError(
                f"shared-memory segment {manifest.segment} holds {size} bytes, version "
                f"{manifest.weights.version} needs {needed}: a partial transfer"
            )

    def _map_out(self, mapped: mmap.mmap, manifest: ShmManifest) -> list[WeightBucket]:
        """Buckets that are views of the mapping, each hashed in place first (the lock keeps the sender out)."""
        weights = manifest.weights
        if weights.total_bytes == 0:
            payload = torch.empty(0, dtype=torch.uint8)
            mapped.close()
        else:
            with warnings.catch_warnings():  # a private writable mapping: torch warns only for read-only buffers
                warnings.simplefilter("ignore")
                # the tensor keeps the mmap object (and so the mapping and its lock) alive until its last user goes
                payload = torch.frombuffer(mapped, dtype=torch.uint8, count=weights.total_bytes, offset=HEADER_BYTES)
        return self._hash_in_place(manifest, payload)

    def _hash_in_place(self, manifest: ShmManifest, payload: torch.Tensor) -> list[WeightBucket]:
        """Hash the mapped ``payload`` span by span on the digest threads and yield views of it once it matches."""
        weights = manifest.weights
        source = payload.numpy()
        jobs = [(i, e.offset + a, e.offset + b)
                for i, e in enumerate(weights.buckets) for a, b in digest_spans(e.nbytes)]
        leaves = list(digest_pool().map(lambda job: digest_leaf(source[job[1]:job[2]]), jobs))
        source = None  # the closure's cell would keep the array, and with it the mapping, alive
        return self._verified(manifest, payload, jobs, leaves)

    def _copy_out(self, mapped: mmap.mmap, manifest: ShmManifest) -> list[WeightBucket] | None:
        """``reuse_buffers`` off: copy the payload into fresh memory, hashing each span as it lands; unmap."""
        weights = manifest.weights
        # one task per digest span, on the digest threads: copy it out of the segment, hash the private copy
        jobs = [(i, e.offset + a, e.offset + b)
                for i, e in enumerate(weights.buckets) for a, b in digest_spans(e.nbytes)]
        payload = torch.empty(weights.total_bytes, dtype=torch.uint8)
        dst = payload.numpy()
        source = None
        try:
            # a read-only mapping cannot back a tensor: copy through numpy, no intermediate bytes
            source = np.frombuffer(mapped, dtype=np.uint8, count=weights.total_bytes, offset=HEADER_BYTES)

            def copy_and_hash(job: tuple[int, int, int]) -> bytes:
                _, a, b = job
                np.copyto(dst[a:b], source[a:b])
                return digest_leaf(dst[a:b])

            leaves = list(digest_pool().map(copy_and_hash, jobs))
            source = None  # release the export so the mapping can close
            if not self._header_matches(mapped, manifest):  # the lock keeps writers out; checked all the same
                return None
        finally:
            source = None
            mapped.close()  # and with it the shared lock
        return self._verified(manifest, payload, jobs, leaves)

    @staticmethod
    def _verified(manifest: ShmManifest, payload: torch.Tensor, jobs: list[tuple[int, int, int]],
                  leaves: list[bytes]) -> list[WeightBucket]:
        weights = manifest.weights
        per_bucket: list[list[bytes]] = [[] for _ in weights.buckets]
        for (i, _, _), leaf in zip(jobs, leaves, strict=True):
            per_bucket[i].append(leaf)
        buckets = buckets_from_payload(weights, payload)
        verify_buckets(buckets, where=f"read from shared memory {manifest.segment}",
                       digests=[digest_root(e.nbytes, p) for e, p in zip(weights.buckets, per_bucket, strict=True)])
        return buckets

    @staticmethod
    def _header_matches(mapped: mmap.mmap | bytes, manifest: ShmManifest) -> bool:
        magic, generation, state, version = HEADER.unpack_from(mapped, 0)
        if magic != MAGIC:
            raise WeightTransferError(f"shared-memory segment {manifest.segment} has no asyncflow header")
        return generation == manifest.generation and state == READY and version == manifest.weights.version

    # ----------------------------------------------------------------- close

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        with self._mappings_lock:
            for kept in self._mappings.values():
                kept.close()  # a version still in use keeps its mapping (and lock) until its last view goes
            self._mappings.clear()
        with self._lock:
            self._slots.clear()
            self._keeper.close()
            # the manifest goes too, unless another sender has replaced it since
            with contextlib.suppress(WeightTransferError):
                current = _read_manifest(self.manifest_path)
                if current is not None and current.owner_token != self._token:
                    self._owned[:] = [p for p in self._owned if p != self.manifest_path]
            self._finalizer()
            self._staged = None

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError("the transport is closed")


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _read_manifest(path: Path) -> ShmManifest | None:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_manifest(text, ShmManifest, source=str(path))
