"""Built-in weight transports: ``inprocess`` (sender and receivers in one process, zero copy), and the
verified cross-process ``shm``, ``dist`` and ``disk`` of :mod:`asyncflow_plugins.weight_transports`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import StagedVersion, TransferReport, TransportFeatures, WeightTransport
from asyncflow_core.plugins import WeightTransportBackend, hookimpl
from asyncflow_core.types import WeightBucket
from asyncflow_core.types import weights


class InProcessTransportConfig(BaseModel):
    """Options of the in-process transport."""

    model_config = ConfigDict(extra="forbid")

    recheck: bool = Field(
        False,
        description="Hash every bucket again on receive, even one whose checksum the sender (pack_buckets, in this "
                    "process) took from that very buffer with no in-place write through torch since. On also "
                    "catches writes that bypass torch's version counter (numpy views, raw pointers), at one more "
                    "pass over the bytes per version.",
    )


class InProcessTransport(WeightTransport):
    """Stages the newest version's buckets in memory; receivers read them by reference.

    Sending checks that the buckets form one whole version (same version,
    indices 0..n-1, last flag only on the final one) before staging it, so a
    receiver never sees half a version. Receiving checks every bucket's
    checksum before yielding any, except a bucket that already verified its
    own buffer with no in-place write through torch since (as
    ``pack_buckets`` leaves its buckets: the sender hashed that very memory);
    ``recheck`` hashes those again too (docs/weight-transports.md,
    "Verification").
    """

    def __init__(self, config: InProcessTransportConfig | None = None) -> None:
        self.config = config or InProcessTransportConfig()
        self._stage: StagedVersion[WeightBucket] = StagedVersion()

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
        version = await self._stage.stage(received)
        nbytes = sum(b.nbytes for b in received)
        return TransferReport(version=version, buckets=len(received), bytes=nbytes, seconds=time.perf_counter() - start)

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        self._check_open()
        _, buckets = await self._stage.wait(min_version, deadline_s=deadline_s)
        buckets = list(buckets)
        where = "staged in this process"
        if self.config.recheck:
            digests = await asyncio.to_thread(weights.weight_digests, [b.buffer for b in buckets])
            weights.verify_buckets(buckets, where=where, digests=digests)
        elif not all(b.verified for b in buckets):
            await asyncio.to_thread(weights.verify_buckets, buckets, where=where)  # in parallel, off the event loop
        for bucket in buckets:
            yield bucket

    async def close(self) -> None:
        await self._stage.close()

    def _check_open(self) -> None:
        if self._stage.closed:
            raise WeightTransferError("the transport is closed")


@hookimpl
def asyncflow_weight_transports():
    yield WeightTransportBackend(
        name="inprocess",
        factory=InProcessTransport,
        config_model=InProcessTransportConfig,
        description="Trainer and rollout engines in one process: buckets staged in memory, read by reference.",
        features=TransportFeatures(cross_process=False, cross_host=False, devices=("cpu", "cuda")),
    )
    # imported here, when the hook runs: importing this module stays cheap
    from asyncflow_plugins.weight_transports import registrations

    yield from registrations()
