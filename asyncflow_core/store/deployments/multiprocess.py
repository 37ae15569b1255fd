"""The multiprocess deployment: one server (controller + arena index), clients in any local process.

Data path. Column bytes live in one shared-memory arena (a 0600 tmpfs file in
the server's private 0700 directory) that every client maps once:

- put: the client asks for ranges (``alloc``), copies each column's packed
  values into them (**one copy**, producer -> shared memory, into warm
  recycled pages), then sends only offsets, dtypes, shapes and ragged
  lengths. The server indexes locations; it never reads or copies payloads.
- get: the server answers with locations and pins them; the client returns
  **views** of the arena when a column's rows lie back to back (the common
  case: rows read in the order they were put), released to the server when
  the last view dies, and otherwise one vectorised gather (**one copy out**).

The reference TransferQueue pickles each payload into its storage unit and
again out of it; here payloads are never serialised, and the server is off
the data path entirely.

Control channel: a persistent, authenticated Unix-socket connection per
client (see :mod:`~asyncflow_core.store.deployments.channel`), messages in a
JSON + raw-buffer encoding (no pickle). A blocking ``get_meta`` waits on the
server for a notification, never by client polling.

The process that creates the store with ``serve=True`` hosts the server in a
background thread; other processes connect with the address and token it
publishes (:attr:`MultiprocessStore.address`, :attr:`MultiprocessStore.token`).
Note: views returned by ``get`` share memory with the store; treat them as
read-only (clone before writing in place).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store.controller import Controller
from asyncflow_core.store.deployments.arena import ArenaAllocator, ArenaFullError, ArenaMapping, create_arena_file
from asyncflow_core.store.deployments.arena_storage import ArenaStorage, ColumnLayout, read_column_ex
from asyncflow_core.store.deployments.channel import Connection, new_token, private_dir
from asyncflow_core.store.deployments.codec import dtype_name
from asyncflow_core.store.deployments.core import StoreCore, check_versions, num_tokens_of, rows_of, split_column
from asyncflow_core.store.deployments.features import MULTIPROCESS_FEATURES
from asyncflow_core.store.deployments.remote import RemoteStoreClient, install_control_ops
from asyncflow_core.store.deployments.server import ServerThread, StoreServer
from asyncflow_core.store.errors import ColumnTypeError, InvalidRequestError
from asyncflow_core.types import Batch, Column

SOCKET_NAME = "store.sock"
ARENA_NAME = "arena"
_THREAD_COPY_BYTES = 8 << 20  # larger copies run off the event loop thread


def build_server(path: str, token: str, arena_path: str, arena_bytes: int, controller: Controller) -> StoreServer:
    """A :class:`StoreServer` with the multiprocess data plane. Call on the loop that will serve it."""
    mapping = ArenaMapping(arena_path, arena_bytes)
    storage = ArenaStorage(mapping, ArenaAllocator(arena_bytes))
    core = StoreCore(controller, on_drop=storage.free)
    server = StoreServer(core, path, token)
    install_control_ops(server, stats_extra=lambda: storage.nbytes)
    server.on_client_gone.append(lambda conn: storage.abandon_owner(conn.id))
    server.on_client_gone.append(lambda conn: [storage.unpin(p) for p in conn.state.pop("pins", set())])

    async def hello(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        return {"arena_path": arena_path, "arena_bytes": arena_bytes}

    async def alloc(conn: Connection, a: dict[str, Any]) -> list[int]:
        sizes = [int(s) for s in a["sizes"]]
        timeout = None if a.get("timeout") is None else float(a["timeout"])

        def attempt() -> list[int] | None:
            try:
                return storage.grant(sizes, conn.id)
            except ArenaFullError:
                if not a.get("block", True):
                    raise InvalidRequestError(
                        f"the shared arena has no room for {sum(sizes)} bytes now; acknowledge rows or raise arena_mb"
                    ) from None
                return None

        return await core.wait_until(
            attempt, timeout, lambda: f"waited {timeout}s for {sum(sizes)} bytes of shared memory; raise arena_mb")

    async def put(conn: Connection, a: dict[str, Any]) -> BatchMeta:
        extents = {k: int(v) for k, v in a["extents"].items()}
        try:
            layouts = {k: ColumnLayout.from_message(d) for k, d in a["columns"].items()}
            n = next(iter(layouts.values())).rows if layouts else 0
            if not layouts:
                raise InvalidRequestError("put() needs at least one column; pass {name: tensor or RaggedTensor}")
            storage.validate(n, layouts, extents, conn.id)
            versions = check_versions(a.get("versions"), n)
            rows: BatchMeta | None = a.get("rows")
            core.check_open()
            if rows is None:
                ids = await core.add_rows(n, a.get("partition", "default"), a.get("group_ids"), a.get("block", True),
                                          a.get("timeout"))
            else:
                ids = torch.as_tensor(rows.row_ids, dtype=torch.int64).reshape(-1)
                if ids.numel() != n:
                    raise ColumnTypeError(f"columns hold {n} rows but rows names {ids.numel()}; give one value per row")
                core.controller.check_rows(ids)
        except BaseException:
            storage.abandon(list(extents.values()))
            raise
        storage.write(ids, layouts, extents)
        tokens = a.get("num_tokens")
        core.mark_ready(ids, list(layouts), versions, tokens)
        return BatchMeta(row_ids=ids, columns=tuple(layouts))

    async def get(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        located, pin = storage.locate(torch.as_tensor(a["row_ids"], dtype=torch.int64), list(a["columns"]))
        conn.state.setdefault("pins", set()).add(pin)
        return {"columns": located, "pin": pin}

    async def unpin(conn: Connection, a: dict[str, Any]) -> None:
        pin = int(a["pin"])
        if pin in conn.state.get("pins", set()):
            conn.state["pins"].discard(pin)
            storage.unpin(pin)

    async def abandon(conn: Connection, a: dict[str, Any]) -> None:
        mine = [int(o) for o in a["offsets"] if storage.extents.get(int(o)) and storage.extents[int(o)].owner == conn.id]
        storage.abandon(mine)

    async def state_dict(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        return {"controller": core.controller.state_dict(), "storage": storage.state_dict()}

    async def load_state_dict(conn: Connection, a: dict[str, Any]) -> None:
        state = a["state"]
        if not isinstance(state, dict) or "controller" not in state or "storage" not in state:
            raise InvalidRequestError("not a store state_dict; pass what state_dict() returned")
        core.controller.load_state_dict(state["controller"])
        storage.load_state_dict(state["storage"])
        core.notify()

    server.ops.update(hello=hello, alloc=alloc, put=put, get=get, unpin=unpin, abandon=abandon, state_dict=state_dict,
                      load_state_dict=load_state_dict)
    return server


class MultiprocessServer:
    """Hosts a multiprocess store server in a background thread of this process; owns its private directory."""

    def __init__(self, *, arena_mb: int = 1024, controller: Controller | None = None, directory: str | None = None,
                 token: str | None = None) -> None:
        self.directory = directory or private_dir()
        self.address = os.path.join(self.directory, SOCKET_NAME)
        self.token = token or new_token()
        arena_path = os.path.join(self.directory, ARENA_NAME)
        arena_bytes = int(arena_mb) << 20
        create_arena_file(arena_path, arena_bytes)
        ctrl = controller or Controller()

        async def setup() -> StoreServer:
            return build_server(self.address, self.token, arena_path, arena_bytes, ctrl)

        self._thread = ServerThread(setup)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and delete the socket and the arena file. Safe to call twice."""
        self._thread.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class MultiprocessStore(RemoteStoreClient):
    """A StreamStore client of a multiprocess server (optionally hosting that server itself).

    ``MultiprocessStore.serve(...)`` starts a server here and returns its
    client; other processes call ``MultiprocessStore(address, token)``.
    """

    def __init__(
        self, address: str, token: str, *, server: MultiprocessServer | None = None,
        token_columns: tuple[str, ...] = ("prompt_ids", "response_ids"),
    ) -> None:
        super().__init__(address, token)
        self.token_columns = tuple(token_columns)
        self._server = server
        self._arena: ArenaMapping | None = None

    @classmethod
    def serve(
        cls, *, arena_mb: int = 1024, controller: Controller | None = None,
        token_columns: tuple[str, ...] = ("prompt_ids", "response_ids"),
    ) -> MultiprocessStore:
        """Start a server in this process and return a client that stops it on :meth:`close`."""
        server = MultiprocessServer(arena_mb=arena_mb, controller=controller)
        return cls(server.address, server.token, server=server, token_columns=token_columns)

    @property
    def token(self) -> str:
        """The secret other processes need to connect (pass it to them privately, e.g. as a spawn argument)."""
        return self._token

    @property
    def features(self) -> StoreFeatures:
        return MULTIPROCESS_FEATURES

    async def _on_connect(self, info: dict[str, Any]) -> None:
        if self._arena is None:
            self._arena = ArenaMapping(info["arena_path"], int(info["arena_bytes"]))

    # -- put -----------------------------------------------------------------------

    async def put(
        self,
        columns: Mapping[str, Column],
        *,
        rows: BatchMeta | None = None,
        partition: str = "default",
        group_ids: torch.Tensor | Any = None,
        versions: torch.Tensor | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> BatchMeta:
        columns = dict(columns)
        n = rows_of(columns)
        payloads: dict[str, torch.Tensor] = {}
        described: dict[str, dict[str, Any]] = {}
        for name, col in columns.items():
            values, lengths = split_column(name, col, n)
            values = values.detach().cpu().contiguous()
            payloads[name] = values
            described[name] = {"ragged": lengths is not None, "dtype": dtype_name(values.dtype),
                               "trailing": list(values.shape[1:]), "rows": n,
                               "lengths": lengths}
        if group_ids is not None:
            group_ids = torch.as_tensor(group_ids, dtype=torch.int64).reshape(-1)
        names = list(payloads)
        sizes = [payloads[k].numel() * payloads[k].element_size() for k in names]
        conn = await self._channel()
        offsets = await self._call("alloc", sizes=sizes, block=block, timeout=timeout)
        try:
            assert self._arena is not None
            for name, off, size in zip(names, offsets, sizes, strict=True):
                if size == 0:
                    continue
                src = payloads[name].reshape(-1).view(torch.uint8)
                dst = self._arena.tensor(off, size)
                if size >= _THREAD_COPY_BYTES:
                    await asyncio.to_thread(dst.copy_, src)
                else:
                    dst.copy_(src)
        except BaseException:
            # the server frees unfinished ranges when told (or when this connection closes)
            conn.notify_nowait("abandon", offsets=list(offsets))
            raise
        for name, off in zip(names, offsets, strict=True):
            described[name]["offset"] = off
        tokens = num_tokens_of(columns, self.token_columns)
        return await self._call(
            "put", columns=described, extents=dict(zip(names, offsets, strict=True)), rows=rows,
            partition=partition, group_ids=group_ids, versions=versions, block=block, timeout=timeout,
            num_tokens=tokens,
        )

    # -- get -----------------------------------------------------------------------

    async def get(self, meta: BatchMeta, columns: Any = None) -> Batch:
        names = list(meta.columns if columns is None else columns)
        conn = await self._channel()
        reply = await self._call("get", row_ids=meta.row_ids, columns=names)
        assert self._arena is not None
        pin = reply["pin"]
        cols: dict[str, Column] = {}
        keepers = []
        try:
            for name in names:
                col, keep = read_column_ex(self._arena, reply["columns"][name], copy=False)
                cols[name] = col
                if keep is not None:
                    keepers.append(keep)
        except BaseException:
            conn.notify_nowait("unpin", pin=pin)
            raise
        if keepers:
            _unpin_when_dead(keepers, conn, pin)
        else:
            conn.notify_nowait("unpin", pin=pin)
        return Batch(cols, row_ids=meta.row_ids, num_rows=len(meta))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._close_channel()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None


def _unpin_when_dead(keepers: list[memoryview], conn: Any, pin: int) -> None:
    """Unpin ``pin`` on the server once every zero-copy range of one get is no longer referenced."""
    loop = asyncio.get_running_loop()
    remaining = [len(keepers)]

    def one_gone() -> None:
        remaining[0] -= 1
        if remaining[0] == 0 and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(functools.partial(conn.notify_nowait, "unpin", pin=pin))
            except RuntimeError:  # the loop closed meanwhile: the server unpins when the connection drops
                pass

    for mv in keepers:
        weakref.finalize(mv, one_gone)
