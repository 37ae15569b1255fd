"""``disk`` weight transport: each version a safetensors file plus a JSON manifest in its own directory.

Layout under ``path``::

    v000000000007/weights.safetensors   one uint8 tensor per bucket: "bucket.00000", ...
    v000000000007/manifest.json         tensor layout and checksums (asyncflow-weights/2)
    .tmp-v000000000008-<pid>-<token>/   a version being written (never read)

The sender writes a version into a temporary directory and renames it to
``vNNNNNNNNNNNN`` when complete: renaming a directory is atomic on one
filesystem, so a receiver sees a whole version or none. Receivers poll for
the newest complete version ``>= min_version`` until their deadline, read it,
and verify every bucket before yielding any. After each send the sender
removes all but the newest ``keep_last`` versions (a receiver that already
opened a removed file keeps reading it; one that had not yet retries with the
newest). Temporary directories left by a killed sender are removed by the next
sender (their pid is in the name).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import TransferReport, TransportFeatures, WeightTransport, check_whole_version
from asyncflow_core.processes import sweep_dead
from asyncflow_core.types import TensorMeta, WeightBucket
from asyncflow_plugins.weight_transports.config import DiskTransportConfig
from asyncflow_plugins.weight_transports.manifest import (
    FORMAT,
    VersionManifest,
    manifest_for,
    parse_manifest,
    verify_all,
)

FEATURES = TransportFeatures(cross_process=True, cross_host=False, devices=("cpu",))
WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{12})$")
_TMP_DIR = re.compile(r"^\.tmp-v\d{12}-(\d+)-[0-9a-f]{12}$")


class DiskManifest(BaseModel):
    """``manifest.json`` of one version directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(WEIGHTS_FILE, description="Safetensors file (in the same directory) holding the buckets.")
    weights: VersionManifest = Field(description="Tensor layout and checksums of the version.")


def _bucket_key(index: int) -> str:
    return f"bucket.{index:05d}"


def _dir_name(version: int) -> str:
    return f"v{version:012d}"


class DiskWeightTransport(WeightTransport):
    """Publishes versions as safetensors directories, renamed into place; receivers poll, read and verify."""

    def __init__(self, config: DiskTransportConfig | None = None) -> None:
        self.config = config or DiskTransportConfig()
        self._private = self.config.path is None
        self.root = Path(tempfile.mkdtemp(prefix="asyncflow-wt-disk-")) if self._private else Path(self.config.path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._token = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._closed = False
        self._swept = False

    @property
    def features(self) -> TransportFeatures:
        return FEATURES

    def versions(self) -> list[int]:
        """Complete versions in the directory, oldest first."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                match = _VERSION_DIR.match(entry.name)
                if match:
                    found.append(int(match.group(1)))
        return sorted(found)

    # ------------------------------------------------------------------ send

    async def send(self, buckets: AsyncIterable[WeightBucket], *, deadline_s: float) -> TransferReport:
        self._check_open()
        start = time.perf_counter()
        cancelled = threading.Event()
        try:
            async with asyncio.timeout(deadline_s):
                received = [b async for b in buckets]
                check_whole_version(received)
                work = asyncio.ensure_future(asyncio.to_thread(self._write, received, cancelled))
                work.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.shield(work)
        except TimeoutError:
            cancelled.set()
            raise WeightTransferError(
                f"writing a weight version to {self.root} did not finish within its {deadline_s:g}s deadline; "
                "the previous version stays current"
            ) from None
        return TransferReport(
            version=received[0].version,
            buckets=len(received),
            bytes=sum(b.nbytes for b in received),
            seconds=time.perf_counter() - start,
        )

    def _write(self, buckets: list[WeightBucket], cancelled: threading.Event) -> None:
        with self._lock:
            if cancelled.is_set() or self._closed:
                raise WeightTransferError("writing was cancelled (deadline passed or transport closed)")
            if not self._swept:
                self._sweep_stale()
            weights = manifest_for(buckets)
            newest = self.versions()
            if newest and weights.version <= newest[-1]:
                raise WeightTransferError(
                    f"version {weights.version} is not newer than version {newest[-1]} already in {self.root}; "
                    "versions must increase (remove the directory to start over)"
                )
            tmp = self.root / f".tmp-{_dir_name(weights.version)}-{os.getpid()}-{self._token}"
            tmp.mkdir()
            try:
                tensors = {}
                for b in buckets:
                    buf = b.buffer.detach().cpu().contiguous().reshape(-1)
                    if buf.untyped_storage().nbytes() != buf.nbytes:
                        buf = buf.clone()  # safetensors refuses tensors that share storage (views of one payload)
                    tensors[_bucket_key(b.index)] = buf
                save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": FORMAT,
                                                                   "version": str(weights.version)})
                (tmp / MANIFEST_FILE).write_text(DiskManifest(weights=weights).model_dump_json())
                if self.config.fsync:
                    for name in (WEIGHTS_FILE, MANIFEST_FILE):
                        _fsync(tmp / name)
                    _fsync(tmp)
                if cancelled.is_set():
                    raise WeightTransferError("writing was cancelled by its deadline")
                os.rename(tmp, self.root / _dir_name(weights.version))
                if self.config.fsync:
                    _fsync(self.root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        versions = self.versions()
        for old in versions[: max(0, len(versions) - self.config.keep_last)]:
            doomed = self.root / f".gc-{_dir_name(old)}-{self._token}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.root / _dir_name(old), doomed)  # out of sight first, then delete
                shutil.rmtree(doomed, ignore_errors=True)

    def _sweep_stale(self) -> None:
        sweep_dead(self.root, _TMP_DIR, directories=True)  # temporary directories of senders that were killed
        self._swept = True

    # --------------------------------------------------------------- receive

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        self._check_open()
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            remaining = end - loop.time()
            versions = self.versions()
            if remaining <= 0:
                newest = versions[-1] if versions else "none"
                raise WeightTransferError(
                    f"no weight version >= {min_version} could be read from {self.root} within {deadline_s:g}s "
                    f"(newest there: {newest})"
                )
            if versions and versions[-1] >= min_version:
                try:
                    async with asyncio.timeout(remaining):
                        buckets = await asyncio.to_thread(self._read, versions[-1])
                except TimeoutError:
                    raise WeightTransferError(
                        f"reading version {versions[-1]} from {self.root} took longer than the {deadline_s:g}s deadline"
                    ) from None
                if buckets is not None:
                    break
                continue  # garbage-collected before we opened it: take the newest again
            await asyncio.sleep(min(self.config.poll_interval_s, remaining))
        for bucket in buckets:
            yield bucket

    def _read(self, version: int) -> list[WeightBucket] | None:
        """Load and verify one version; ``None`` if it was garbage-collected before we opened it."""
        folder = self.root / _dir_name(version)
        try:
            manifest_bytes = (folder / MANIFEST_FILE).read_bytes()
        except FileNotFoundError:
            if not folder.exists():
                return None  # garbage-collected (the whole directory is renamed away at once)
            raise WeightTransferError(f"{folder} has no {MANIFEST_FILE}: a partial transfer") from None
        try:
            manifest = parse_manifest(manifest_bytes, DiskManifest, source=str(folder / MANIFEST_FILE))
            if manifest.weights.version != version:
                raise WeightTransferError(
                    f"{folder} holds version {manifest.weights.version} according to its manifest, not {version}"
                )
            if manifest.file != WEIGHTS_FILE:
                raise WeightTransferError(f"the manifest in {folder} names an unexpected file {manifest.file!r}")
            buckets = []
            with safe_open(folder / manifest.file, framework="pt") as f:
                present = set(f.keys())
                for entry in manifest.weights.buckets:
                    key = _bucket_key(entry.index)
                    if key not in present:
                        raise WeightTransferError(
                            f"weight bucket {entry.index} of version {version} is missing from {folder}: "
                            "a partial transfer"
                        )
                    buffer = f.get_tensor(key)
                    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != entry.nbytes:
                        raise WeightTransferError(
                            f"weight bucket {entry.index} of version {version} in {folder} has "
                            f"{buffer.numel()} bytes, its manifest says {entry.nbytes}: a partial transfer"
                        )
                    buckets.append(
                        WeightBucket(
                            version=version,
                            index=entry.index,
                            metas=tuple(TensorMeta(t.name, t.dtype, tuple(t.shape), t.offset) for t in entry.tensors),
                            buffer=buffer,
                            checksum=entry.checksum,
                            last=entry.last,
                        )
                    )
        except FileNotFoundError:
            if not folder.exists():
                return None
            raise WeightTransferError(f"{folder} has no {WEIGHTS_FILE}: a partial transfer") from None
        except (SafetensorError, OSError) as exc:
            raise WeightTransferError(f"version {version} in {folder} cannot be read: {exc}") from None
        verify_all(buckets, where=f"read from {folder / WEIGHTS_FILE}")
        return buckets

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._lock.acquire)  # let a write in flight finish or clean up after itself
        self._lock.release()
        if self._private:
            shutil.rmtree(self.root, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError("the transport is closed")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
