"""The actors' side of the weight path that skips the driver (``launcher.options.weights``; see :mod:`.weights`).

:class:`WeightSender` runs in the trainer actor (puts a version in the object
store, or broadcasts it as rank 0 of the dist group); :class:`WeightReceiver`
in each rollout actor (its rank of the dist group). Ray is imported only
where a version is put in the object store.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import KVCachePolicy, WeightTransport
from asyncflow_core.launchers.ray.handles import WeightHandle
from asyncflow_core.types import WeightBucket


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dist_transport(**options: Any) -> WeightTransport:
    """The ``dist`` weight transport plugin (found through the plugin manager: core imports no plugin)."""
    from asyncflow_core.plugins import get_plugin_manager

    return get_plugin_manager().create("weight_transport", "dist", options)


async def _aiter(items: Sequence[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class WeightSender:
    """The trainer actor's side: puts a version in the object store, or broadcasts it to the dist group."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group: WeightTransport | None = None
        self.generation = 0
        self.last: list[WeightBucket] | None = None  #: the last version broadcast (for catch-ups over the store)
        self._sending: asyncio.Task | None = None
        self._abandoned: str | None = None  #: why the driver abandoned the send in flight

    async def _export(self, bucket_bytes: int) -> list[WeightBucket]:
        return [b async for b in self.engine.export_weights(bucket_bytes=bucket_bytes)]

    async def put(self, bucket_bytes: int) -> list[WeightHandle]:
        """Export the current version into the object store; one handle per bucket (the buffers stay here)."""
        import ray

        return [WeightHandle.of(b, ray.put(b)) for b in await self._export(bucket_bytes)]

    async def open_group(self, generation: int, world_size: int, backend: str, join_timeout_s: float,
                         chunk_mb: float) -> int:
        """Open rank 0 of a new group on a free loopback port (the receivers join it); returns the port."""
        await self.close_group()
        port = _free_loopback_port()
        self.group = _dist_transport(rank=0, world_size=world_size, port=port, backend=backend,
                                     join_timeout_s=join_timeout_s, chunk_mb=chunk_mb)
        self.generation = generation
        return port

    async def send(self, bucket_bytes: int, deadline_s: float) -> list[WeightHandle]:
        """Export the current version and broadcast it; returns once every rank verified and staged it."""
        if self.group is None:
            raise WeightTransferError("no weight group is open on the trainer actor (open_weight_group first)")
        buckets = await self._export(bucket_bytes)
        self._abandoned = None
        self._sending = asyncio.ensure_future(self.group.send(_aiter(buckets), deadline_s=deadline_s))
        try:
            await self._sending
        except asyncio.CancelledError:
            if self._abandoned is None:
                raise
            raise WeightTransferError(f"the broadcast of version {buckets[0].version} was abandoned: "
                                      f"{self._abandoned}") from None
        finally:
            self._sending = None
        self.last = buckets
        return [WeightHandle.of(b, None, self.generation) for b in buckets]

    def abandon(self, reason: str) -> bool:
        """Give up the send in flight (a rank of the group died); True if there was one.

        The group is dropped, not closed: the plugin's worker thread may still
        be waiting on the dead rank (until the send's own deadline), and a
        group is never shut down under a thread that uses it. The driver forms
        a new group before the next send.
        """
        if self._sending is None or self._sending.done():
            return False
        self._abandoned = reason
        self.group = None
        self._sending.cancel()
        return True

    async def put_last(self, min_version: int) -> list[WeightHandle]:
        """Put the last version sent (>= ``min_version``) in the object store, for a replica outside the group."""
        import ray

        if self.last is None or self.last[0].version < min_version:
            held = "none" if self.last is None else self.last[0].version
            raise WeightTransferError(f"a replica asked for version >= {min_version} to catch up, the trainer actor "
                                      f"holds {held}")
        return [WeightHandle.of(b, ray.put(b)) for b in self.last]

    async def close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            await group.close()


class WeightReceiver:
    """A rollout actor's side of the dist group: its rank's transport, and loading what it staged."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group: WeightTransport | None = None

    async def open_group(self, port: int, world_size: int, rank: int, backend: str, join_timeout_s: float,
                         chunk_mb: float) -> None:
        await self.close_group()
        self.group = _dist_transport(rank=rank, world_size=world_size, port=port, backend=backend,
                                     join_timeout_s=join_timeout_s, chunk_mb=chunk_mb)

    async def load(self, min_version: int, deadline_s: float, kv_cache: KVCachePolicy) -> int:
        """Load the newest version >= ``min_version`` this rank received (waiting up to ``deadline_s``)."""
        if self.group is None:
            raise WeightTransferError("this rollout actor is in no weight group; it catches up over the object store")
        stream = self.group.receive(min_version=min_version, deadline_s=deadline_s)
        first = await stream.__anext__()

        async def chain() -> AsyncIterator[WeightBucket]:
            yield first
            async for b in stream:
                yield b

        await self.engine.update_weights(first.version, chain(), kv_cache=kv_cache)
        return int(self.engine.version)

    async def close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            await group.close()


__all__ = ["WeightReceiver", "WeightSender"]
