"""What the multiprocess and distributed deployments share: control operations and their client.

Server side, :func:`install_control_ops` maps the control calls of the
StreamStore API onto a :class:`StoreCore`; client side,
:class:`RemoteStoreClient` implements them as requests on one persistent
:class:`ChannelClient` per event loop. Deployments add ``put`` and ``get``
(their data planes differ).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.store.deployments.channel import ChannelClient, ChannelError, Connection
from asyncflow_core.store.deployments.server import StoreServer
from asyncflow_core.store.errors import StoreClosedError


def install_control_ops(server: StoreServer, stats_extra: Any = None) -> None:
    """Serve the control calls (everything but put/get/state) from ``server.core``."""
    core = server.core

    async def register_task(conn: Connection, a: dict[str, Any]) -> None:
        core.register_task(a["task"], a.get("consumes") or (), a.get("produces") or (), a.get("partition"))

    async def get_meta(conn: Connection, a: dict[str, Any]) -> BatchMeta:
        kw = dict(a["kw"])
        kw["consumer"] = server.consumer_for(conn, kw.get("consumer"))
        return await core.get_meta(a["task"], a["columns"], a["batch_size"], **kw)

    async def ack(conn: Connection, a: dict[str, Any]) -> None:
        core.ack(a["meta"])

    async def release(conn: Connection, a: dict[str, Any]) -> None:
        core.release(a["meta"])

    async def renew(conn: Connection, a: dict[str, Any]) -> float | None:
        return core.renew(a["meta"], a.get("lease_s"))

    async def declare_dead(conn: Connection, a: dict[str, Any]) -> int:
        return core.declare_dead(a["consumer"])

    async def end_stream(conn: Connection, a: dict[str, Any]) -> None:
        core.end_stream(a.get("partition"))

    async def clear(conn: Connection, a: dict[str, Any]) -> int:
        return core.clear(a.get("partition"))

    async def stats(conn: Connection, a: dict[str, Any]) -> dict[str, int]:
        out = core.controller.stats()
        out["bytes_stored"] = int(stats_extra()) if stats_extra is not None else 0
        return out

    server.ops.update(
        register_task=register_task, get_meta=get_meta, ack=ack, release=release, renew=renew,
        declare_dead=declare_dead, end_stream=end_stream, clear=clear, stats=stats,
    )


class RemoteStoreClient(StreamStore):
    """Client half of a served store: control calls over the channel; subclasses add put/get."""

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self._token = token
        self.client_id = f"client-{uuid.uuid4().hex}"
        self._conn: ChannelClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._closed = False
        self.server_info: dict[str, Any] = {}

    async def _channel(self) -> ChannelClient:
        """The connection for the running event loop (reconnects when called from a new loop)."""
        if self._closed:
            raise StoreClosedError("this store client was closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._conn is not None and self._loop is loop:
            return self._conn
        if self._loop is not loop:
            self._connect_lock = asyncio.Lock()
            self._conn = None
        assert self._connect_lock is not None
        async with self._connect_lock:
            if self._conn is None:
                conn = ChannelClient(self.address, self._token)
                await conn.connect()
                self.server_info = await conn.call("hello", client=self.client_id) or {}
                await self._on_connect(self.server_info)
                self._conn, self._loop = conn, loop
        return self._conn

    async def _on_connect(self, info: dict[str, Any]) -> None:
        """Hook: set up the data plane from the server's hello answer."""

    async def _call(self, op: str, **args: Any) -> Any:
        conn = await self._channel()
        try:
            return await conn.call(op, **args)
        except ChannelError as exc:
            raise StoreClosedError(f"lost the store server at {self.address}: {exc}") from exc

    async def register_task(self, task: str, *, consumes: Sequence[str] = (), produces: Sequence[str] = (),
                            partition: str | None = None) -> None:
        await self._call("register_task", task=task, consumes=list(consumes), produces=list(produces),
                         partition=partition)

    async def get_meta(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: str | None = None,
        min_version: int | None = None,
        partition: str | None = None,
        partial: bool = False,
        timeout: float | None = None,
        lease_s: float | None = None,
        consumer: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> BatchMeta:
        kw = dict(sampler=sampler, min_version=min_version, partition=partition, partial=partial, timeout=timeout,
                  lease_s=lease_s, consumer=consumer, dp_rank=dp_rank, dp_size=dp_size)
        return await self._call("get_meta", task=task, columns=list(columns), batch_size=batch_size, kw=kw)

    async def ack(self, meta: BatchMeta) -> None:
        await self._call("ack", meta=meta)

    async def release(self, meta: BatchMeta) -> None:
        await self._call("release", meta=meta)

    async def renew(self, meta: BatchMeta, *, lease_s: float | None = None) -> float | None:
        return await self._call("renew", meta=meta, lease_s=lease_s)

    async def declare_dead(self, consumer: str) -> int:
        return await self._call("declare_dead", consumer=consumer)

    async def end_stream(self, partition: str | None = None) -> None:
        await self._call("end_stream", partition=partition)

    async def clear(self, partition: str | None = None) -> int:
        return await self._call("clear", partition=partition)

    async def state_dict(self) -> dict[str, Any]:
        return await self._call("state_dict")

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._call("load_state_dict", state=state)

    async def stats(self) -> dict[str, int]:
        return await self._call("stats")

    async def _close_channel(self) -> None:
        if self._conn is not None and self._loop is asyncio.get_running_loop():
            await self._conn.close()
        self._conn = None
