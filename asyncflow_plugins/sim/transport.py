"""``sim`` weight transport: real (tiny) buckets, modelled transfer time on the loop's clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import (
    StagedVersion,
    TransferReport,
    TransportFeatures,
    WeightTransport,
    check_whole_version,
)
from asyncflow_core.types import WeightBucket
from asyncflow_plugins.sim.latency import TransferLatency

FEATURES = TransportFeatures(cross_process=False, cross_host=False, devices=("cpu", "cuda"))


class SimTransportConfig(BaseModel):
    """Options of the ``sim`` weight transport."""

    model_config = ConfigDict(extra="forbid")

    latency: TransferLatency = Field(default_factory=TransferLatency, description="Cost model of a transfer.")
    use_payload_bytes: bool = Field(
        False,
        description="Model the bytes actually sent instead of latency.model_bytes (for real weights through sim).",
    )
    time_scale: float = Field(
        1.0, gt=0, description="Loop seconds per modelled second; < 1 makes runs on a real event loop fast (tests)."
    )


@dataclass
class SimTransportStats:
    """Counters (modelled seconds, not multiplied by ``time_scale``)."""

    sends: int = 0
    receives: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    deadline_failures: int = 0


class SimWeightTransport(WeightTransport):
    """Stages the newest version in memory like ``inprocess``; every send and receive costs modelled time.

    ``send`` costs ``latency.send_time(bytes)`` and ``receive`` (per
    receiver) ``latency.receive_time(bytes)``, where bytes is the nominal
    ``model_bytes`` (a 7B model's 15.2 GB by default) although the buckets
    themselves are tiny. When the modelled time does not fit the call's
    ``deadline_s``, the call spends the whole deadline and then raises
    :class:`WeightTransferError` saying so. Buckets are verified on send and
    on receive.
    """

    def __init__(self, config: SimTransportConfig | None = None) -> None:
        self.config = config or SimTransportConfig()
        self._lat = self.config.latency
        self.stats = SimTransportStats()
        self._stage: StagedVersion[WeightBucket] = StagedVersion()

    @property
    def features(self) -> TransportFeatures:
        return FEATURES

    def _nbytes(self, buckets: list[WeightBucket]) -> float:
        return float(sum(b.nbytes for b in buckets)) if self.config.use_payload_bytes else self._lat.model_bytes

    async def _spend(self, seconds: float, deadline_s: float, what: str) -> None:
        if seconds > deadline_s:
            await asyncio.sleep(max(deadline_s, 0.0) * self.config.time_scale)
            self.stats.deadline_failures += 1
            raise WeightTransferError(
                f"{what} takes {seconds:.3g}s in the latency model ({self._lat.model_bytes / 1e9:.3g} GB nominal at "
                f"the configured bandwidth + {self._lat.latency_s:g}s latency), more than its {deadline_s:g}s deadline"
            )
        await asyncio.sleep(seconds * self.config.time_scale)

    async def send(self, buckets: AsyncIterable[WeightBucket], *, deadline_s: float) -> TransferReport:
        self._check_open()
        loop = asyncio.get_running_loop()
        start = loop.time()
        received = [b async for b in buckets]
        version = check_whole_version(received)
        for bucket in received:
            bucket.verify()
        self._stage.check_newer(version)  # before the modelled time is spent
        seconds = self._lat.send_time(self._nbytes(received))
        await self._spend(seconds, deadline_s, f"sending version {version}")
        await self._stage.stage(received)
        self.stats.sends += 1
        self.stats.send_seconds += seconds
        return TransferReport(
            version=version,
            buckets=len(received),
            bytes=sum(b.nbytes for b in received),
            seconds=(loop.time() - start) / self.config.time_scale,
        )

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        self._check_open()
        loop = asyncio.get_running_loop()
        start = loop.time()
        version, buckets = await self._stage.wait(min_version, deadline_s=deadline_s,
                                                  timeout_s=deadline_s * self.config.time_scale)
        waited = (loop.time() - start) / self.config.time_scale
        seconds = self._lat.receive_time(self._nbytes(buckets))
        await self._spend(seconds, deadline_s - waited, f"receiving version {version}")
        self.stats.receives += 1
        self.stats.receive_seconds += seconds
        for bucket in buckets:
            bucket.verify()
            yield bucket

    async def close(self) -> None:
        await self._stage.close()

    def _check_open(self) -> None:
        if self._stage.closed:
            raise WeightTransferError("the transport is closed")
