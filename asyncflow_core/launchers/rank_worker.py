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
(:meth:`RankWorkerBase.ship_buckets`), ``export_done``, and the checkpoint
frame (RNG per rank, the meta file ``asyncflow_<name>.json`` written last,
the tokenizer copied next to exported weights). The engine's worker
subclasses it, sets ``engine_name`` and implements ``setup``, ``logprobs``,
``train``, ``export_plan``, ``export_chunk``, ``save``, ``load`` and
``export_hf`` with its framework. Its config has ``timeout_s``,
``cpu_threads_per_rank``, ``export_dtype`` and ``model``.
"""

from __future__ import annotations

import json
import os
import pickle
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
        c = self.config
        torch.set_num_threads(c.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // (self.world_size + others)))

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

    @staticmethod
    def ship_buckets(named: list[tuple[str, torch.Tensor]], payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Pack ``named`` tensors into buckets, each handed to the driver in a shared-memory segment."""
        out = []
        for bucket in pack_buckets(named, version=payload["version"], bucket_bytes=payload["bucket_bytes"]):
            out.append({"metas": bucket.metas, "checksum": bucket.checksum, "nbytes": bucket.nbytes,
                        "shm": to_shared_memory(bucket.buffer)})
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
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - tearing down; the driver reaps us anyway
                pass


__all__ = ["DTYPES", "EMPTY_PASS", "TOKENIZER_FILES", "RankWorkerBase", "aligned", "load_algorithm",
           "loopback_interface", "plan_chunks", "rank_device", "serve", "to_shared_memory"]
