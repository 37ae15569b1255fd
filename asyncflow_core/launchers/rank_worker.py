"""The rank side a train engine over a rank group shares, whatever framework its ranks run (fsdp, megatron).

The driver side is :mod:`asyncflow_core.launchers.rank_driver`. A rank is
one process serving the driver's commands over a private
``multiprocessing`` pipe (``pickle`` messages): :func:`serve` reads
``(op, payload)``, calls the worker's ``op_<op>`` and answers
``("ok", result)`` or ``("error", (type, message, traceback))`` until
``shutdown`` or until the driver goes away.

:class:`RankWorkerBase` holds what every engine's worker does alike: the
loopback rendezvous (``bind``, then :meth:`RankWorkerBase.join_group` in the
engine's ``setup``), ``ping``, the export protocol's plan grouping
(:func:`plan_chunks`) and shared-memory hand-over
(:meth:`RankWorkerBase.ship_buckets`, into :class:`KeptSegments` reused
across versions), ``export_done``, and the checkpoint
frame (RNG per rank, the meta file ``asyncflow_<name>.json`` written last,
the tokenizer copied next to exported weights). The engine's worker
subclasses it, sets ``engine_name`` and implements ``setup``, ``logprobs``,
``train``, ``export_plan``, ``export_chunk``, ``save``, ``load`` and
``export_hf`` with its framework. Its config has ``timeout_s``,
``cpu_threads_per_rank``, ``export_dtype`` and ``model``.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import re
import shutil
import socket
import traceback
from collections.abc import Iterable
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from asyncflow_core import columns as C
from asyncflow_core import kept_segments
from asyncflow_core.kept_segments import SHM_DIR, KeptSegment, SegmentKeeper
from asyncflow_core.processes import sweep_dead
from asyncflow_core.types import Batch, RaggedTensor, pack_buckets
from asyncflow_core.types.weights import BUCKET_ALIGNMENT

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")

#: a one-row pass a rank without rows runs, so that it joins the same collectives as the others
EMPTY_PASS = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences([[0]]),
                    C.RESPONSE_IDS: RaggedTensor.from_sequences([[0]])})


def serve(worker: Any, conn: Any) -> None:
    """Answer the driver's commands with ``worker`` until ``shutdown`` or until the driver goes away."""
    try:
        while True:
            try:
                op, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone: nothing left to serve
            if op == "shutdown":
                worker.close()
                conn.send_bytes(pickle.dumps(("ok", None)))
                return
            try:
                reply = ("ok", getattr(worker, f"op_{op}")(payload))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver with its reason
                reply = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
            conn.send_bytes(pickle.dumps(reply))
    finally:
        worker.close()


def loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` or ``lo0``), if this host has one."""
    names = [name for _, name in socket.if_nameindex()]
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def rank_device(rank: int, visible_devices: int) -> torch.device:
    """The CUDA device of ``rank`` among the ``visible_devices`` this rank's process sees.

    A rank group lives on one host (the core's rank group: child processes,
    or Ray actors that must share one node), so the global rank is the local
    rank. Child processes see every GPU of the host: rank r takes GPU r. A Ray
    rank actor sees only the GPU Ray gave it (``CUDA_VISIBLE_DEVICES``), so
    ``rank % 1`` is its device 0. Call this, then ``torch.cuda.set_device``,
    before anything allocates on CUDA: otherwise every rank's first allocation
    (and NCCL's communicator) lands on GPU 0.
    """
    if visible_devices < 1:
        raise RuntimeError(f"rank {rank} sees no CUDA device (torch.cuda.device_count() is 0); check "
                           "CUDA_VISIBLE_DEVICES, or use device: cpu")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return torch.device("cuda", rank % visible_devices)


def load_algorithm(data: bytes) -> Any:
    """The algorithm the driver pickled (:meth:`RankEngineDriver._step_inputs`), rebuilt in this rank."""
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise ValueError(f"the algorithm could not be rebuilt in the rank process ({exc}); define its class "
                         "in an importable module (ranks re-import the driver's __main__ as multiprocessing's "
                         "spawn does, so guard scripts with `if __name__ == '__main__':`)") from exc


def aligned(n: int) -> int:
    """``n`` bytes rounded up to the bucket alignment (what one tensor takes in a bucket buffer)."""
    return (n + BUCKET_ALIGNMENT - 1) // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT


def plan_chunks(items: Iterable[tuple[T, int]], bucket_bytes: int) -> list[list[T]]:
    """Group ``(item, aligned bytes)`` in order, a new group when the next would pass ``bucket_bytes``.

    The same rule as ``pack_buckets``; an item larger than ``bucket_bytes``
    gets a group of its own. Always at least one (possibly empty) group.
    """
    chunks: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item, nbytes in items:
        if current and size + nbytes > bucket_bytes:
            chunks.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    chunks.append(current)
    return chunks


#: Name prefix of the segments a rank keeps across exports (the driver maps them and never unlinks them)
KEPT_PREFIX = "asyncflow-rank-"
#: Name prefix of a fresh segment a rank hands over when all of a bucket's kept ones are mapped (the driver unlinks it)
FRESH_PREFIX = "asyncflow-rankx-"
_OURS = re.compile(r"^asyncflow-rankx?-(\d+)-[0-9a-f]{12}-\d+$")


class KeptSegments:
    """Shared-memory segments a rank keeps across weight exports, reused once the driver no longer maps them.

    A fresh segment per bucket per export means fresh tmpfs pages, and the
    first write to each page faults. Instead each bucket position (chunk
    ``i``, bucket ``j``) has up to ``max_per_bucket`` kept segments; an
    export packs the bucket straight into one (``pack_buckets(...,
    allocate=)``: one copy, no private buffer first) that no driver maps.

    The protocol is :mod:`asyncflow_core.kept_segments` (the ``shm`` weight
    transport's too): the driver maps a kept segment under a shared
    ``flock`` held for as long as its mapping lives, and the rank rewrites a
    segment only after taking the exclusive lock without waiting, which
    fails while any driver still maps it: a driver holding the previous
    version (a transport has it staged) keeps its segments, and the rank
    packs into another. The driver never unlinks a kept segment; the rank
    unlinks them when it closes (or its process exits), and segments of a
    rank that was killed are removed by the next rank that starts on the
    host (their pid, in the name, is dead). The lock of a driver that dies
    goes with its process. With every kept segment of a position mapped, or
    no room in ``/dev/shm`` to keep one more, a bucket gets a fresh segment
    that the driver unlinks (as before).
    """

    def __init__(self, *, directory: Path = SHM_DIR, max_per_bucket: int = 2) -> None:
        self.dir = Path(directory)
        self.max_per_bucket = max_per_bucket
        sweep_dead(self.dir, _OURS)  # segments of ranks that died without closing
        self._keeper = SegmentKeeper(self.dir, KEPT_PREFIX)
        self._kept: dict[tuple[int, int], list[KeptSegment]] = {}
        self._locked: list[KeptSegment] = []
        self._stats = {"reused_bytes": 0, "kept_new_bytes": 0, "fresh_bytes": 0}

    def allocator(self, chunk: int, named: dict[int, tuple[str, bool]]) -> Any:
        """``allocate(nbytes)`` for one chunk's buckets; records each bucket's segment name and whether it is kept."""
        j = 0

        def allocate(nbytes: int) -> torch.Tensor:
            nonlocal j
            key, j = (chunk, j), j + 1
            segment = self._take(key, nbytes)
            if segment is None:  # every kept segment of this position is mapped: a fresh one, unlinked by the driver
                self._stats["fresh_bytes"] += nbytes
                path = self._keeper.name(prefix=FRESH_PREFIX)
                named[key[1]] = (path.name, False)
                return _fresh_segment(path, nbytes)
            named[key[1]] = (segment.path.name, True)
            assert segment.view is not None
            return segment.view[:nbytes]

        return allocate

    def _take(self, key: tuple[int, int], nbytes: int) -> KeptSegment | None:
        kept = self._kept.setdefault(key, [])
        for segment in list(kept):
            if segment.try_lock():
                if segment.size >= nbytes:
                    self._locked.append(segment)
                    self._stats["reused_bytes"] += nbytes
                    return segment
                segment.unlock()  # too small for this bucket now (the export grew): make room for a new one
            elif segment.path.exists():
                continue  # a driver maps it
            kept.remove(segment)  # too small, or unlinked by someone else: of no further use
            self._keeper.drop(segment)
        if len(kept) >= self.max_per_bucket or nbytes == 0:
            return None
        free = kept_segments.shm_free_bytes(self.dir)
        if free is not None and free < 2 * nbytes:  # keeping one more would leave no room for the next bucket
            return None
        segment = self._keeper.create(nbytes)  # holds its exclusive lock: nobody else can have it open yet
        kept.append(segment)
        self._locked.append(segment)
        self._stats["kept_new_bytes"] += nbytes
        return segment

    def release(self) -> None:
        """After packing: the segments may be mapped by the driver (which takes its shared lock)."""
        for segment in self._locked:
            segment.unlock()
        self._locked = []

    def stats(self) -> dict[str, int]:
        """Bytes packed into reused kept segments, into new kept ones, and into fresh unkept ones; segments kept."""
        return {**self._stats, "segments": len(self._keeper)}

    def close(self) -> None:
        self._locked = []
        self._keeper.close()


def _fresh_segment(path: Path, nbytes: int) -> torch.Tensor:
    """A new segment file the driver owns (it maps and unlinks it): a writable view of it."""
    kept_segments.check_shm_room(path.parent, nbytes)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping alive
    finally:
        os.close(fd)


def to_shared_memory(buffer: torch.Tensor) -> str:
    """Copy a bucket buffer into a new shared-memory segment; the driver copies it out and unlinks it."""
    n = buffer.numel()
    shm = shared_memory.SharedMemory(create=True, size=max(n, 1))
    # the driver owns the segment from here on (it unlinks it): keep this process's tracker from unlinking it too
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    view = np.ndarray((n,), dtype=np.uint8, buffer=shm.buf)
    view[:] = buffer.detach().cpu().numpy()
    del view
    name = shm.name
    shm.close()
    return name


class RankWorkerBase:
    """The state and commands every engine's rank shares (see the module); the engine's worker subclasses it."""

    engine_name: ClassVar[str] = "rank"

    def __init__(self, rank: int, world_size: int, config: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.device = torch.device("cpu")
        self._listen_fd: int | None = None
        self._export_chunks: list[Any] = []
        self._segments: KeptSegments | None = None

    @property
    def meta_file(self) -> str:
        """Written last by ``save``: its presence marks a complete checkpoint."""
        return f"asyncflow_{self.engine_name}.json"

    @property
    def checkpoint_format(self) -> str:
        return f"asyncflow-{self.engine_name}/1"

    # -- start ------------------------------------------------------------------

    def op_bind(self, _payload: Any) -> int | None:
        """Rank 0 binds the rendezvous socket on 127.0.0.1 (a free port, no race) and says which port."""
        if self.rank != 0:
            return None
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        # the TCPStore polls this fd for the life of the process: detach so Python never closes it under the store
        self._listen_fd = listener.detach()
        return port

    def set_cpu_threads(self, others: int = 0) -> None:
        """This rank's intra-op threads: ``cpu_threads_per_rank``, or the host's cores shared by the ranks and
        ``others`` more busy processes (an engine whose driver computes beside its ranks counts it here)."""
        from asyncflow_core.launchers.ranks import rank_cpu_threads

        torch.set_num_threads(rank_cpu_threads(self.world_size, others, self.config.cpu_threads_per_rank))

    def join_group(self, port: int, backend: str) -> None:
        """Join the default process group, rendezvous on loopback at rank 0's ``port`` (from ``bind``)."""
        lo = loopback_interface()
        if lo is not None:  # gloo's and NCCL's own sockets on loopback too, not only the rendezvous
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
        timeout = timedelta(seconds=self.config.timeout_s)
        if self.rank == 0:
            store = dist.TCPStore("127.0.0.1", port, self.world_size, True, timeout=timeout,
                                  master_listen_fd=self._listen_fd, use_libuv=False)
        else:
            store = dist.TCPStore("127.0.0.1", port, self.world_size, False, timeout=timeout, use_libuv=False)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)

    # -- export -----------------------------------------------------------------

    def _export_dtype(self) -> torch.dtype:
        c = self.config
        name = c.export_dtype if c.export_dtype != "auto" else (c.model.dtype if c.model else "float32")
        return DTYPES[name]

    def ship_buckets(self, named: list[tuple[str, torch.Tensor]], payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Pack ``named`` tensors straight into shared-memory segments, one per bucket, handed to the driver.

        On Linux the segments are :class:`KeptSegments`, reused across
        versions once the driver no longer maps them (``"kept": True``: the
        driver maps and never unlinks them); elsewhere each bucket is copied
        into a fresh segment the driver copies out and unlinks.
        """
        version, bucket_bytes = payload["version"], payload["bucket_bytes"]
        if not SHM_DIR.is_dir():
            return [{"metas": b.metas, "checksum": b.checksum, "nbytes": b.nbytes, "shm": to_shared_memory(b.buffer),
                     "kept": False} for b in pack_buckets(named, version=version, bucket_bytes=bucket_bytes)]
        if getattr(self, "_segments", None) is None:
            self._segments = KeptSegments()
        segments = self._segments
        assert segments is not None
        names: dict[int, tuple[str, bool]] = {}
        out = []
        try:
            allocate = segments.allocator(int(payload.get("index", 0)), names)
            for j, bucket in enumerate(pack_buckets(named, version=version, bucket_bytes=bucket_bytes,
                                                    allocate=allocate)):
                name, kept = names[j]
                out.append({"metas": bucket.metas, "checksum": bucket.checksum, "nbytes": bucket.nbytes,
                            "shm": name, "kept": kept})
        finally:
            segments.release()  # packed: the driver may map them now
        return out

    def op_export_done(self, _payload: Any) -> None:
        self._export_chunks = []

    def copy_tokenizer(self, path: Path) -> None:
        """Keep the model's tokenizer files next to exported weights, so the directory is a complete checkpoint."""
        source = self.config.model.path if self.config.model else None
        if source:
            for name in TOKENIZER_FILES:
                if (Path(source) / name).is_file():
                    shutil.copy2(Path(source) / name, path / name)

    # -- checkpoints ------------------------------------------------------------

    def finish_save(self, path: Path, meta: dict[str, Any]) -> None:
        """After every rank wrote its part: RNG state per rank, then rank 0 writes the meta file (format added)."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, path / f"rng_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            tmp = path / (self.meta_file + ".tmp")
            tmp.write_text(json.dumps({"format": self.checkpoint_format, **meta}, indent=2))
            tmp.replace(path / self.meta_file)
        dist.barrier()

    def read_meta(self, path: Path) -> dict[str, Any]:
        return json.loads((path / self.meta_file).read_text())

    def finish_load(self, path: Path, meta: dict[str, Any]) -> int:
        """After every rank loaded its part: this rank's RNG state (same world size only); the checkpoint's version."""
        rng_file = path / f"rng_rank{self.rank}.pt"
        if meta.get("world_size") == self.world_size and rng_file.exists():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        dist.barrier()
        return int(meta["version"])

    # -- misc -------------------------------------------------------------------

    def op_ping(self, _payload: Any) -> int:
        return os.getpid()

    def close(self) -> None:
        if getattr(self, "_segments", None) is not None:
            self._segments.close()  # unlinks the kept segments; a driver still mapping one keeps its pages
            self._segments = None
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - tearing down; the driver reaps us anyway
                pass


__all__ = ["DTYPES", "EMPTY_PASS", "FRESH_PREFIX", "KEPT_PREFIX", "SHM_DIR", "TOKENIZER_FILES", "KeptSegments",
           "RankWorkerBase", "aligned", "load_algorithm", "loopback_interface", "plan_chunks", "rank_device", "serve",
           "to_shared_memory"]
