"""What the driver stages under ``launcher.options.weights`` ``object_store`` / ``dist``: handles, never bytes.

A :class:`WeightHandle` describes one bucket of a version (layout, checksum,
the object-store reference, or the dist group that carried its bytes);
:class:`HandleTransport` is the driver's weight transport that stages them.
The trainer actor (:mod:`.weight_actors`) makes handles and the driver
(:mod:`.remote`, :mod:`.weights`) passes them on; this module imports
neither, nor Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import StagedVersion, TransferReport, TransportFeatures, WeightTransport
from asyncflow_core.types import TensorMeta, WeightBucket

WeightsMode = Literal["object_store", "dist", "driver"]
#: the default of ``launcher.options.weights`` (measured in benchmarks/ray_weights.py, see docs/performance.md)
DEFAULT_MODE: WeightsMode = "object_store"


@dataclasses.dataclass(frozen=True)
class WeightHandle:
    """One bucket of a version, without its bytes: what the driver stages instead of a :class:`WeightBucket`.

    ``ref`` is the object-store reference of the whole :class:`WeightBucket`
    (put by the trainer actor) or None when the bytes went to the replicas by
    broadcast (``dist``; ``generation`` says which group carried them).
    """

    version: int
    index: int
    metas: tuple[TensorMeta, ...]
    checksum: str
    last: bool
    nbytes: int
    ref: Any = None
    generation: int = 0

    @classmethod
    def of(cls, bucket: WeightBucket, ref: Any = None, generation: int = 0) -> WeightHandle:
        return cls(bucket.version, bucket.index, tuple(bucket.metas), bucket.checksum, bucket.last, bucket.nbytes,
                   ref, generation)


class HandleTransport(WeightTransport):
    """The driver's weight transport under ``weights: object_store | dist``: stages handles, never bytes.

    It keeps the newest whole version only. Staging a newer one drops the
    older handles, which releases their objects once no replica is loading
    them (Ray keeps an object alive while a call that was given its
    reference runs), and a replica that restarts later is given the newest.
    Receivers get the handles unverified: there are no bytes here to check;
    the replica's engine verifies every bucket it fetches against its checksum.
    """

    def __init__(self, mode: WeightsMode, on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.mode = mode
        self._on_close = on_close  #: closes what carried the bytes (the dist group's ranks)
        self._stage: StagedVersion[WeightHandle] = StagedVersion()

    @property
    def features(self) -> TransportFeatures:
        return TransportFeatures(cross_process=True, cross_host=self.mode == "object_store", devices=("cpu", "cuda"))

    @property
    def staged_versions(self) -> list[int]:
        """Versions whose handles this transport holds (at most one)."""
        return [] if self._stage.version is None else [self._stage.version]

    async def send(self, buckets: AsyncIterable[Any], *, deadline_s: float) -> TransferReport:
        self._check_open()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                received = [b async for b in buckets]
        except TimeoutError:
            raise WeightTransferError(f"weight send did not finish within its {deadline_s:g}s deadline") from None
        stray = [type(b).__name__ for b in received if not isinstance(b, WeightHandle)]
        if stray:
            raise WeightTransferError(
                f"launcher.options.weights={self.mode!r} stages weight handles, but the trainer sent {stray[0]}; "
                "the trainer is not the ray launcher's (set launcher.options.weights=driver to carry buckets)"
            )
        version = await self._stage.stage(received)  # the older handles go: their objects are freed when unused
        return TransferReport(version=version, buckets=len(received), bytes=sum(h.nbytes for h in received),
                              seconds=time.perf_counter() - start)

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightHandle]:
        self._check_open()
        _, handles = await self._stage.wait(min_version, deadline_s=deadline_s)
        for handle in handles:
            yield handle

    async def close(self) -> None:
        if self._stage.closed:
            return
        await self._stage.close()
        if self._on_close is not None:
            await self._on_close()

    def _check_open(self) -> None:
        if self._stage.closed:
            raise WeightTransferError("the transport is closed")


__all__ = ["DEFAULT_MODE", "HandleTransport", "WeightHandle", "WeightsMode"]
