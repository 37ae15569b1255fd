"""The WeightTransport contract: move a weight version from trainer to rollout engines."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces.features import TransportFeatures
from asyncflow_core.types import WeightBucket

T = TypeVar("T")


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


def check_whole_version(buckets: Sequence[Any]) -> int:
    """The version of ``buckets`` when they form one whole version: one version, indices 0..n-1, ``last`` on the final.

    Works on anything with ``version``, ``index`` and ``last`` (buckets, or
    handles to buckets held elsewhere). Raises :class:`WeightTransferError`
    saying what is wrong.
    """
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


class StagedVersion(Generic[T]):
    """The newest whole version a transport holds in memory, and the wait for one (for transports to build on).

    :meth:`stage` checks the version is whole and newer than the one held,
    then replaces it (the older one is dropped); :meth:`wait` blocks until a
    version >= ``min_version`` is held or the stage is closed. Both raise
    :class:`WeightTransferError` with the contract's messages.
    """

    def __init__(self) -> None:
        self._staged: tuple[int, list[T]] | None = None
        self._changed = asyncio.Condition()
        self.closed = False

    @property
    def version(self) -> int | None:
        """The version held, or None."""
        return None if self._staged is None else self._staged[0]

    def check_newer(self, version: int) -> None:
        """Raise unless ``version`` is newer than the one held (versions only move forward)."""
        if self._staged is not None and version <= self._staged[0]:
            raise WeightTransferError(
                f"version {version} is not newer than the staged version {self._staged[0]}; versions must increase"
            )

    async def stage(self, items: list[T]) -> int:
        """Hold ``items`` (one whole version, newer than the one held) in place of the older; returns its version."""
        version = check_whole_version(items)
        async with self._changed:
            self.check_newer(version)
            self._staged = (version, items)
            self._changed.notify_all()
        return version

    async def wait(self, min_version: int, *, deadline_s: float, timeout_s: float | None = None) -> tuple[int, list[T]]:
        """The held version once it is >= ``min_version``: ``(version, items)``.

        Waits at most ``timeout_s`` (default ``deadline_s``; a transport on a
        scaled clock passes both, the message names ``deadline_s``).
        """
        try:
            async with asyncio.timeout(deadline_s if timeout_s is None else timeout_s):
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: self.closed or (self._staged is not None and self._staged[0] >= min_version)
                    )
        except TimeoutError:
            staged = "none" if self._staged is None else str(self._staged[0])
            raise WeightTransferError(
                f"no weight version >= {min_version} was staged within {deadline_s:g}s (newest staged: {staged})"
            ) from None
        if self.closed or self._staged is None:
            raise WeightTransferError("the transport is closed")
        return self._staged

    async def close(self) -> None:
        """Drop the held version and wake every waiter (they raise: the transport is closed)."""
        self.closed = True
        self._staged = None
        async with self._changed:
            self._changed.notify_all()
