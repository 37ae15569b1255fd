"""Built-in weight transports: ``inprocess`` (sender and receivers in one process, zero copy), and the
verified cross-process ``shm``, ``dist`` and ``disk`` of :mod:`asyncflow_plugins.weight_transports`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator

from pydantic import BaseModel, ConfigDict

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import TransferReport, TransportFeatures, WeightTransport
from asyncflow_core.plugins import WeightTransportBackend, hookimpl
from asyncflow_core.types import WeightBucket


class InProcessTransportConfig(BaseModel):
    """The in-process transport takes no options."""

    model_config = ConfigDict(extra="forbid")


class InProcessTransport(WeightTransport):
    """Stages the newest version's buckets in memory; receivers read them by reference.

    Sending checks that the buckets form one whole version (same version,
    indices 0..n-1, last flag only on the final one) before staging it, so a
    receiver never sees half a version.
    """

    def __init__(self, config: InProcessTransportConfig | None = None) -> None:
        self._staged: tuple[int, list[WeightBucket]] | None = None
        self._changed = asyncio.Condition()
        self._closed = False

    @property
    def features(self) -> TransportFeatures:
        return TransportFeatures(cross_process=False, cross_host=False, devices=("cpu", "cuda"))

    async def send(self, buckets: AsyncIterable[WeightBucket], *, deadline_s: float) -> TransferReport:
        self._check_open()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                received = [b async for b in buckets]
        except TimeoutError:
            raise WeightTransferError(f"weight send did not finish within its {deadline_s:g}s deadline") from None
        version = _check_whole_version(received)
        async with self._changed:
            if self._staged is not None and version <= self._staged[0]:
                raise WeightTransferError(
                    f"version {version} is not newer than the staged version {self._staged[0]}; versions must increase"
                )
            self._staged = (version, received)
            self._changed.notify_all()
        nbytes = sum(b.nbytes for b in received)
        return TransferReport(version=version, buckets=len(received), bytes=nbytes, seconds=time.perf_counter() - start)

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        self._check_open()
        try:
            async with asyncio.timeout(deadline_s):
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: self._closed or (self._staged is not None and self._staged[0] >= min_version)
                    )
        except TimeoutError:
            staged = "none" if self._staged is None else str(self._staged[0])
            raise WeightTransferError(
                f"no weight version >= {min_version} was staged within {deadline_s:g}s (newest staged: {staged})"
            ) from None
        self._check_open()
        assert self._staged is not None
        for bucket in self._staged[1]:
            bucket.verify()
            yield bucket

    async def close(self) -> None:
        self._closed = True
        async with self._changed:
            self._changed.notify_all()
        self._staged = None

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError("the transport is closed")


def _check_whole_version(buckets: list[WeightBucket]) -> int:
    if not buckets:
        raise WeightTransferError("a send must carry at least one bucket")
    versions = {b.version for b in buckets}
    if len(versions) != 1:
        raise WeightTransferError(f"a send must carry one version, got {sorted(versions)}")
    indices = [b.index for b in buckets]
    if indices != list(range(len(buckets))):
        raise WeightTransferError(f"bucket indices must be 0..{len(buckets) - 1} in order, got {indices}")
    lasts = [b.last for b in buckets]
    if not lasts[-1] or any(lasts[:-1]):
        raise WeightTransferError("only the final bucket of a version may (and must) have last=True")
    return versions.pop()


@hookimpl
def asyncflow_weight_transports():
    yield WeightTransportBackend(
        name="inprocess",
        factory=InProcessTransport,
        config_model=InProcessTransportConfig,
        description="Trainer and rollout engines in one process: buckets staged in memory, read by reference.",
        features=TransportFeatures(cross_process=False, cross_host=False, devices=("cpu", "cuda")),
    )
    # imported here: the package imports ``_check_whole_version`` from this module
    from asyncflow_plugins.weight_transports import registrations

    yield from registrations()
