"""The authenticated control channel: one persistent Unix-socket connection per client.

Security, in layers:

1. The socket lives in a private directory (mode 0700) and is itself 0600,
   so only the owning user's processes can connect at all.
2. Each connection must prove knowledge of a secret token before anything
   else is read: the server sends a random nonce, the client answers
   ``HMAC-SHA256(token, "c" | server nonce | client nonce)`` and the server
   answers with its own HMAC, so both sides authenticate each other and the
   token never crosses the socket. The handshake reads fixed-size byte
   strings only; no message is decoded before it succeeds.
3. Messages are decoded with :mod:`~asyncflow_core.store.deployments.codec`
   (JSON header + raw buffers), never with pickle.

Unlike the reference TransferQueue client, which opens a ZMQ connection per
request, a client keeps one connection and multiplexes concurrent requests on
it by request id, so a blocking ``get_meta`` and a ``put`` may be in flight
together.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import re
import secrets
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from hashlib import sha256
from typing import Any

from asyncflow_core.processes import sweep_dead
from asyncflow_core.store.deployments.codec import decode, encode

NONCE_BYTES = 32
MAX_FRAME_BYTES = 1 << 31
_LEN = struct.Struct("<Q")
HANDSHAKE_TIMEOUT_S = 10.0


class ChannelError(ConnectionError):
    """The control channel failed: authentication refused, or the peer went away."""


def new_token() -> str:
    """A fresh secret for a store server (hex, 256 bits)."""
    return secrets.token_hex(32)


def private_dir(prefix: str = "asyncflow-store-") -> str:
    """A new directory only this user can enter (0700), on tmpfs when available.

    Its name carries this process's id (``<prefix><pid>-<random>``): a server
    that is killed cannot remove its directory (and the arena file in it,
    whose touched pages stay in memory on tmpfs), so each new one first
    removes this user's directories of ``prefix`` whose process is gone.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    sweep_dead_dirs(base or tempfile.gettempdir(), prefix)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
    os.chmod(path, 0o700)
    return path


def sweep_dead_dirs(base: str, prefix: str) -> list[str]:
    """Remove this user's ``<prefix><pid>-*`` directories under ``base`` whose process no longer exists; their
    paths."""
    return sweep_dead(base, re.compile(re.escape(prefix) + r"(\d+)-"), directories=True)


def _mac(token: str, tag: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token.encode(), tag + a + b, sha256).digest()


async def _write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    parts = encode(obj)
    total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    writer.write(_LEN.pack(total))
    writer.writelines(parts)
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME_BYTES:
        raise ChannelError(f"control frame of {n} bytes is larger than the {MAX_FRAME_BYTES} allowed")
    return decode(await reader.readexactly(n))


Handler = Callable[["Connection", str, dict[str, Any]], Awaitable[Any]]


class Connection:
    """The server's view of one authenticated client connection."""

    _next_id = 0

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        Connection._next_id += 1
        self.id = Connection._next_id
        self.writer = writer
        self.state: dict[str, Any] = {}  #: per-connection bookkeeping of the server (consumers, pins)
        self._lock = asyncio.Lock()

    async def send(self, obj: Any) -> None:
        async with self._lock:  # frames of concurrent replies must not interleave
            await _write_frame(self.writer, obj)


class ChannelServer:
    """Serves requests ``{"id", "op", "args"}`` with ``handler(conn, op, args)`` on a Unix socket.

    Each request runs as its own task, so a blocking request (a waiting
    ``get_meta``) never holds up the others on the connection.
    ``on_disconnect(conn)`` runs when a client goes away (closed or crashed).
    """

    def __init__(
        self,
        path: str,
        token: str,
        handler: Handler,
        on_disconnect: Callable[[Connection], Awaitable[None]] | None = None,
    ) -> None:
        self.path = path
        self.token = token
        self.handler = handler
        self.on_disconnect = on_disconnect
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        old_umask = os.umask(0o177)  # the socket is created 0600: no window where others may connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=1 << 20)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(server_nonce)
        await writer.drain()
        blob = await reader.readexactly(NONCE_BYTES + 32)
        client_nonce, client_mac = blob[:NONCE_BYTES], blob[NONCE_BYTES:]
        if not hmac.compare_digest(client_mac, _mac(self.token, b"c", server_nonce, client_nonce)):
            return False
        writer.write(_mac(self.token, b"s", client_nonce, server_nonce))
        await writer.drain()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        conn = Connection(writer)
        authed = False
        inflight: set[asyncio.Task] = set()
        try:
            authed = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_TIMEOUT_S)
            if not authed:
                return  # unauthenticated bytes are dropped unread
            while True:
                msg = await _read_frame(reader)
                t = asyncio.ensure_future(self._dispatch(conn, msg))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        finally:
            for t in list(inflight):
                t.cancel()
            if authed and self.on_disconnect is not None:
                with contextlib.suppress(Exception):
                    await self.on_disconnect(conn)
            writer.close()
            self._conns.discard(task)

    async def _dispatch(self, conn: Connection, msg: dict[str, Any]) -> None:
        rid = msg.get("id")
        try:
            result = await self.handler(conn, str(msg["op"]), msg.get("args") or {})
            reply = {"id": rid, "ok": result}
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller, typed
            reply = {"id": rid, "err": exc}
        if rid is None:
            return  # a one-way notification (e.g. unpin): no reply
        with contextlib.suppress(ConnectionError):
            await conn.send(reply)


class ChannelClient:
    """One persistent, authenticated connection to a :class:`ChannelServer`, shared by concurrent calls.

    Bound to the event loop that called :meth:`connect`.
    """

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self.token = token
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self._read_task: asyncio.Task | None = None
        self._send_lock: asyncio.Lock | None = None
        self._closed_error: BaseException | None = None

    async def connect(self) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ChannelError(
                f"no store server at {self.path}: start the server first (or check the `address` option)"
            ) from exc
        server_nonce = await reader.readexactly(NONCE_BYTES)
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(client_nonce + _mac(self.token, b"c", server_nonce, client_nonce))
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.readexactly(32), HANDSHAKE_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            raise ChannelError(
                f"the store server at {self.path} refused the token: pass the token the server was started with"
            ) from exc
        if not hmac.compare_digest(answer, _mac(self.token, b"s", client_nonce, server_nonce)):
            writer.close()
            raise ChannelError(f"the server at {self.path} could not prove it knows the token; not talking to it")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self._reader, self._writer = reader, writer
        self._send_lock = asyncio.Lock()
        self._read_task = asyncio.ensure_future(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                msg = await _read_frame(self._reader)
                fut = self._pending.pop(msg.get("id"), None)
                if fut is None or fut.done():
                    continue
                if "err" in msg:
                    fut.set_exception(msg["err"])
                else:
                    fut.set_result(msg.get("ok"))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._fail(ChannelError(f"the store server at {self.path} closed the connection"), exc)
        except asyncio.CancelledError:
            self._fail(ChannelError("the store client was closed"), None)
            raise
        except BaseException as exc:  # a malformed frame: nothing on this connection can be trusted
            self._fail(ChannelError(f"control channel failed: {exc}"), exc)

    def _fail(self, err: BaseException, cause: BaseException | None) -> None:
        err.__cause__ = cause
        self._closed_error = err
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    async def call(self, op: str, **args: Any) -> Any:
        """Send a request and wait for its reply; a remote error is raised here with its type."""
        if self._closed_error is not None:
            raise self._closed_error
        assert self._writer is not None and self._send_lock is not None, "connect() first"
        self._next += 1
        rid = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            async with self._send_lock:
                await _write_frame(self._writer, {"id": rid, "op": op, "args": args})
        except (ConnectionError, RuntimeError) as exc:
            self._pending.pop(rid, None)
            raise ChannelError(f"the store server at {self.path} is gone") from exc
        try:
            return await fut
        finally:
            self._pending.pop(rid, None)

    def notify_nowait(self, op: str, **args: Any) -> None:
        """Fire-and-forget message (no reply); safe to call from a finalizer on the loop thread."""
        if self._writer is None or self._closed_error is not None or self._writer.is_closing():
            return
        parts = encode({"id": None, "op": op, "args": args})
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        # a whole frame is written synchronously, so it cannot interleave with an awaited write's frame
        # (StreamWriter.write buffers atomically; only drain() awaits)
        self._writer.write(_LEN.pack(total) + b"".join(bytes(p) for p in parts))

    async def close(self) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(BaseException):
                await self._read_task
            self._read_task = None
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None
