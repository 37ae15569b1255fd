"""The WeightTransport contract: move a weight version from trainer to rollout engines."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterable, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces.features import TransportFeatures
from asyncflow_core.types import WeightBucket


class TransferReport(BaseModel):
    """What one send moved."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(description="Weight version sent.")
    buckets: int = Field(description="Number of buckets.")
    bytes: int = Field(description="Payload bytes (sum of bucket buffers).")
    seconds: float = Field(description="Wall time from the first bucket to the last being staged or delivered.")


class WeightTransport(abc.ABC):
    """Moves weight buckets from one sender (the trainer) to receivers (rollout engines).

    A version is sent as a whole (buckets in index order, ending with
    ``last=True``). The transport keeps at most the newest fully staged
    version; receivers fetch it when they reach a safe point. Every call has a
    deadline: a transfer that cannot finish in time raises
    :class:`~asyncflow_core.errors.WeightTransferError` with the reason — it
    never hangs. Every received bucket is verified before it is yielded.
    """

    @property
    @abc.abstractmethod
    def features(self) -> TransportFeatures:
        """Where sender and receivers may live (see :class:`TransportFeatures`)."""

    @abc.abstractmethod
    async def send(self, buckets: AsyncIterable[WeightBucket], *, deadline_s: float) -> TransferReport:
        """Stage one version. Returns once it can be received (for broadcast
        transports: once every receiver has it). Raises ``WeightTransferError``
        on a deadline, a gap in bucket indices, mixed versions or a missing last bucket;
        then the previously staged version stays current.
        """

    @abc.abstractmethod
    def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        """Yield the buckets of the newest staged version that is ``>= min_version``.

        Waits (up to the deadline) until such a version is staged. Every
        yielded bucket has passed ``verify()``; a corrupted or missing one
        raises ``WeightTransferError``.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release buffers, groups and files. Safe to call twice."""
