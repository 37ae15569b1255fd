"""The store server: a :class:`StoreCore` plus a data plane, served on the authenticated control channel.

It runs on its own event loop in a background thread of the process that
hosts it (:class:`ServerThread`), so the hosting process's own code, sync or
async, talks to it through the same socket as every other process.

Dead consumers: a lease taken with ``consumer=None`` is held in the name of
the *client* (a random id each client sends once); when every connection of
a client has gone (its process exited or crashed), the server declares that
client, and every consumer name only it used, dead, so its leases come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from asyncflow_core.store.deployments.channel import ChannelServer, Connection
from asyncflow_core.store.deployments.core import StoreCore

Op = Callable[[Connection, dict[str, Any]], Awaitable[Any]]


class StoreServer:
    """Dispatches control-channel requests to ``ops`` (name -> coroutine) and tracks clients for dead-consumer recovery."""

    def __init__(self, core: StoreCore, path: str, token: str) -> None:
        self.core = core
        self.ops: dict[str, Op] = {}
        self.channel = ChannelServer(path, token, self._handle, self._disconnected)
        self._client_conns: dict[str, set[int]] = defaultdict(set)
        self._consumer_clients: dict[str, set[str]] = defaultdict(set)
        self.on_client_gone: list[Callable[[Connection], None]] = []

    def client_of(self, conn: Connection) -> str:
        return conn.state.get("client", f"conn-{conn.id}")

    def consumer_for(self, conn: Connection, consumer: str | None) -> str:
        """The lease holder's name: the caller's own, or its client id."""
        client = self.client_of(conn)
        name = consumer if consumer is not None else client
        self._consumer_clients[name].add(client)
        return name

    async def _handle(self, conn: Connection, op: str, args: dict[str, Any]) -> Any:
        if op == "hello":
            client = str(args.get("client") or f"conn-{conn.id}")
            conn.state["client"] = client
            self._client_conns[client].add(conn.id)
            return await self.ops["hello"](conn, args) if "hello" in self.ops else None
        fn = self.ops.get(op)
        if fn is None:
            raise ValueError(f"unknown store operation {op!r}; client and server versions differ")
        return await fn(conn, args)

    async def _disconnected(self, conn: Connection) -> None:
        for cb in self.on_client_gone:
            cb(conn)
        client = conn.state.get("client")
        if client is None:
            return
        conns = self._client_conns.get(client, set())
        conns.discard(conn.id)
        if conns:
            return  # the client reconnected (e.g. from another event loop): it is alive
        self._client_conns.pop(client, None)
        if self.core.closed:
            return
        for name, clients in list(self._consumer_clients.items()):
            clients.discard(client)
            if not clients:
                del self._consumer_clients[name]
                self.core.declare_dead(name)


class ServerThread:
    """Runs ``setup(loop) -> StoreServer`` on a private event loop in a daemon thread."""

    def __init__(self, setup: Callable[[], Awaitable[StoreServer]]) -> None:
        self._setup = setup
        self.loop = asyncio.new_event_loop()
        self.server: StoreServer | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncflow-store-server", daemon=True)

    def start(self) -> StoreServer:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        assert self.server is not None
        return self.server

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def boot() -> None:
            try:
                self.server = await self._setup()
                await self.server.channel.start()
            except BaseException as exc:  # noqa: BLE001 - surfaced by start()
                self._error = exc
            finally:
                self._started.set()

        self.loop.run_until_complete(boot())
        if self._error is None:
            self.loop.run_forever()
        self.loop.close()

    def stop(self) -> None:
        """Close the store (waking waiters), stop serving, join the thread. Safe to call twice."""
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self.server is not None:
                self.server.core.close()
                await self.server.channel.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
