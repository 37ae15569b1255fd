"""The distributed deployment: the reference "NCCL streaming store" on torch.distributed.

One rank (``server_rank``) hosts the controller and the storage unit; every
other rank of the process group is a client. Control calls go over the
authenticated control channel of the multiprocess deployment (one Unix
socket per store, see :mod:`.channel`), so control ranks share the server's
host; column values move point to point with ``torch.distributed``
(gloo on CPU, NCCL with device tensors that go straight over NCCL).

Announce before receive. A receive is posted only for a transfer the peer
has already committed to on the control channel (a gloo receive that times
out poisons the pair):

- put: the client announces the layout (names, dtypes, shapes, ragged
  lengths) in ``put_begin``; the server validates it against the columns'
  schema (a bad put is refused here, before any transfer), grants ranges of
  its arena, posts its receives *into the arena* and answers with the
  transfer's sequence number; the client sends, and ``put_end`` commits the
  rows (ready bits set with the data) once the receives completed.
- get: the server posts its sends (views of the arena, or one gather when
  rows are scattered) and answers with the layout and sequence number; the
  client posts receives sized from that layout.

Messages: each column of 256 KiB or more travels as its own message with no
copy on either side; smaller columns are packed into one message (one small
copy). Each message's tag is its sequence number, counted per lane (one per
client rank, see :mod:`.p2p`) by the server, and both sides *issue* a lane's
operations in sequence order from one thread per process: NCCL ignores tags
and matches a pair's operations in issue order, gloo matches by tag; both
hold. Waits run on a separate thread pool, so the event loops never block on
the network.

NCCL (read against torch 2.13.0, never run here). Each rank's CUDA device is
chosen once, in the thread that builds the store or the host (``device=``,
else ``LOCAL_RANK``, else that thread's current device), set before the
default group forms (``init_loopback_process_group`` passes it as
``device_id``) and in every store thread that touches NCCL. Transfers do not
use the user's process group: each client rank gets a 2-rank NCCL group of
its own (a lane), so that a dead client, whose posted receives NCCL would
leave pending forever, costs only its lane: the server waits for them for a
short grace (:data:`ABANDON_GRACE_S`), then aborts that lane's group (its
kernels exit, no process is torn down), reuses the arena ranges once the
receives are seen to end, and forms a new lane on the next transfer. Every
NCCL wait on either side is bounded the same way by ``timeout_s``.

The server rank uses its own stores through a local path: a put copies into
the arena and a get copies out of it, with no point-to-point to itself.

Finding the server: the server rank writes its control socket and secret
token under ``asyncflow/store/<server_rank>`` in the process group's
rendezvous key-value store (the TCPStore every rank already trusts: whoever
can reach it can join the group), and clients read it there, so no secret
is passed by hand. Each store is a named instance on the server: ranks that
open the same ``name`` share it (the first opener's options win);
``name=None`` opens a fresh private instance that its client drops on close.

Dead consumers: a rank that dies drops its control connection and the server
frees its leases (see :class:`~.server.StoreServer`) and, once its posted
transfers ended or were abandoned as above, the arena ranges of its puts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store.deployments.arena import ArenaAllocator, ArenaFullError
from asyncflow_core.store.deployments.arena_storage import ArenaStorage, ColumnLayout
from asyncflow_core.store.deployments.channel import ChannelClient, Connection, new_token, private_dir
from asyncflow_core.store.deployments.codec import dtype_from_name, dtype_name
from asyncflow_core.store.deployments.config import DistributedStoreConfig
from asyncflow_core.store.deployments.core import StoreCore, check_versions, num_tokens_of, rows_of, split_column
from asyncflow_core.store.deployments.nccl_support import DeviceSpec, resolve_cuda_device, use_device
from asyncflow_core.store.deployments.p2p import Lane, P2PLink, link_for, memory_in_use
from asyncflow_core.store.deployments.remote import RemoteStoreClient, install_control_ops
from asyncflow_core.store.deployments.server import ServerThread, StoreServer
from asyncflow_core.store.storage import check_column_schema
from asyncflow_core.store.errors import ColumnTypeError, InvalidRequestError, StoreClosedError
from asyncflow_core.types import Batch, Column, RaggedTensor

SMALL_COLUMN_BYTES = 256 << 10  #: columns below this share one packed message
_ALIGN = 64
KEY_PREFIX = "asyncflow/store/"
ABANDON_GRACE_S = 5.0  #: how long a gone client's posted transfers may still finish before its lane is aborted
_LANE_ATTEMPTS = 3
_log = logging.getLogger(__name__)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ====================================================================== the wire plan


def plan_messages(sizes: list[int]) -> tuple[list[int], dict[int, int], int]:
    """How a transfer's columns (byte sizes, in column order) map to messages; both sides compute it.

    Returns ``(big, small_offsets, small_total)``: ``big`` lists the columns
    sent as their own message, ``small_offsets`` maps each packed column to its
    byte offset in the packed message of ``small_total`` bytes (sent first,
    when not empty). Empty columns travel in no message.
    """
    big = [i for i, s in enumerate(sizes) if s >= SMALL_COLUMN_BYTES]
    small_offsets: dict[int, int] = {}
    pos = 0
    for i, s in enumerate(sizes):
        if 0 < s < SMALL_COLUMN_BYTES:
            small_offsets[i] = pos
            pos += _round_up(s)
    return big, small_offsets, pos


def _count_messages(sizes: list[int]) -> int:
    big, _, small_total = plan_messages(sizes)
    return len(big) + (1 if small_total else 0)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


# ====================================================================== devices


def data_plane_device(backend: str, device: DeviceSpec = None) -> torch.device:
    """The data plane's device: this rank's CUDA device when the group speaks NCCL, else the CPU (gloo).

    The CUDA device is chosen by :func:`.nccl_support.resolve_cuda_device`
    (``device``, else ``LOCAL_RANK``, else the calling thread's current
    device); call it in the thread the caller configured, not a helper thread.
    """
    if "nccl" in backend and torch.cuda.is_available():
        return resolve_cuda_device(device)
    return torch.device("cpu")


def ensure_process_group(config: DistributedStoreConfig, device: DeviceSpec = None) -> None:
    """Initialise torch.distributed from the environment when asked; otherwise insist it already is.

    ``device``: this rank's CUDA device for ``backend: nccl`` (see :func:`init_loopback_process_group`).
    """
    if dist.is_available() and dist.is_initialized():
        return
    from asyncflow_core.errors import ConfigError

    if not config.init_process_group:
        raise ConfigError(
            "the distributed store needs torch.distributed: call torch.distributed.init_process_group() first, or "
            "set init_process_group: true with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in the environment"
        )
    # torch's env:// rendezvous makes rank 0's TCPStore listen on every interface, whatever MASTER_ADDR says;
    # this store is single-host (its control channel is a Unix socket), so the group it starts is loopback-only
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    missing = [k for k, v in env.items() if not v]
    if missing:
        raise ConfigError(f"store.options.init_process_group: true needs {', '.join(missing)} in the environment")
    if not _is_loopback_host(env["MASTER_ADDR"] or ""):
        raise ConfigError(
            f"MASTER_ADDR={env['MASTER_ADDR']} is not a loopback address: the distributed store starts only "
            "single-host groups bound to 127.0.0.1; set MASTER_ADDR=127.0.0.1, or join your multi-host group "
            "yourself (torch.distributed.init_process_group) before opening the store"
        )
    try:
        rank, world_size, port = int(env["RANK"] or ""), int(env["WORLD_SIZE"] or ""), int(env["MASTER_PORT"] or "")
    except ValueError:
        raise ConfigError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers, got {env}") from None
    init_loopback_process_group(rank, world_size, port, backend=config.backend, timeout_s=config.timeout_s,
                                device=device)


def _is_loopback_host(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _kv_store() -> Any:
    return dist.distributed_c10d._get_default_store()


# ====================================================================== the server rank


class DeviceArena:
    """The server's column memory: one flat uint8 tensor on the data-plane device (the ``ArenaMapping`` API)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.bytes[offset : offset + nbytes]


@dataclass
class _Instance:
    name: str
    address: str
    token: str
    server: StoreServer
    storage: ArenaStorage
    private: bool
    xfers: dict[int, dict[str, Any]] = field(default_factory=dict)


class DistributedHost:
    """Runs on the server rank: every store instance (controller + arena storage) on one event loop thread.

    ``DistributedHost.start(config)`` creates the instance ``config.name``,
    starts serving and publishes the control address in the rendezvous store.
    ``device`` is this rank's CUDA device under NCCL (:func:`data_plane_device`);
    ``pair_groups`` forces one process group per client lane on the CPU too
    (:class:`.p2p.P2PLink`; by default only the CUDA data plane uses them).
    """

    def __init__(self, config: DistributedStoreConfig, group: Any = None, *, device: DeviceSpec = None,
                 pair_groups: bool | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank()
        self.backend = str(dist.get_backend(group))
        self.device = data_plane_device(self.backend, device)
        self.timeout_s = float(config.timeout_s)  #: bounds each transfer's wait (and lane formation) on this rank
        self.link = link_for(group, self.device, pair_groups=pair_groups)
        self.directory = private_dir("asyncflow-dstore-")
        self.instances: dict[str, _Instance] = {}
        self._opening: dict[str, asyncio.Future] = {}
        name = config.name or "default"
        self.default_name = name

        async def setup() -> StoreServer:
            inst = self._build(name, config, private=False)
            return inst.server

        self._thread = ServerThread(setup)
        self._thread.start()
        first = self.instances[name]
        self.address, self.token = first.address, first.token
        _HOSTS[self.rank] = self

    @classmethod
    def start(cls, config: DistributedStoreConfig | None = None, group: Any = None, publish: bool = True, *,
              device: DeviceSpec = None, pair_groups: bool | None = None) -> DistributedHost:
        """Start hosting on this rank and (``publish``) tell the other ranks where to find it."""
        host = cls(config or DistributedStoreConfig(), group, device=device, pair_groups=pair_groups)
        if publish:
            _kv_store().set(KEY_PREFIX + str(host.rank), json.dumps({"address": host.address, "token": host.token}))
        return host

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._thread.loop

    # -- instances -------------------------------------------------------------------

    def _build(self, name: str, config: DistributedStoreConfig, private: bool) -> _Instance:
        """A new store instance with its own socket and token (call on the host loop; start its channel after)."""
        address = os.path.join(self.directory, f"{len(self.instances)}-{uuid.uuid4().hex[:8]}.sock")
        token = new_token()
        arena = DeviceArena(int(config.arena_mb) << 20, self.device)
        storage = ArenaStorage(arena, ArenaAllocator(arena.nbytes))  # type: ignore[arg-type]
        core = StoreCore(config.controller(), on_drop=storage.free)
        server = StoreServer(core, address, token)
        inst = _Instance(name, address, token, server, storage, private)
        install_control_ops(server, stats_extra=lambda: storage.nbytes)
        _install_data_ops(self, inst)
        self.instances[name] = inst
        return inst

    async def open(self, name: str | None, options: dict[str, Any]) -> dict[str, Any]:
        """The instance ``name`` (created with ``options`` if absent), or a new private one for ``name=None``."""
        if name is not None and name in self.instances:
            inst = self.instances[name]
            return {"name": name, "address": inst.address, "token": inst.token}
        if name is not None and name in self._opening:
            return await asyncio.shield(self._opening[name])
        config = DistributedStoreConfig.model_validate(options)
        key = name or f"private-{uuid.uuid4().hex[:12]}"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            inst = self._build(key, config, private=name is None)
            await inst.server.channel.start()
            out = {"name": key, "address": inst.address, "token": inst.token}
            fut.set_result(out)
            return out
        except BaseException as exc:
            self.instances.pop(key, None)
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        finally:
            self._opening.pop(key, None)

    async def drop(self, name: str) -> None:
        """Close instance ``name`` (waking its waiters with StoreClosedError) and forget it."""
        inst = self.instances.pop(name, None)
        if inst is None:
            return
        inst.server.core.close()
        await inst.server.channel.close()

    def stop(self) -> None:
        """Close every instance, stop the loop thread, delete the sockets. Safe to call twice."""
        if _HOSTS.get(self.rank) is self:
            del _HOSTS[self.rank]
            with contextlib.suppress(Exception):
                _kv_store().delete_key(KEY_PREFIX + str(self.rank))
        if self._thread._thread.is_alive():
            async def close_all() -> None:
                for name in [n for n in self.instances if n != self.default_name]:
                    await self.drop(name)

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(timeout=30)
        self._thread.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


_HOSTS: dict[int, DistributedHost] = {}


def _layouts_from(described: dict[str, Any], n: int) -> dict[str, ColumnLayout]:
    if not described:
        raise InvalidRequestError("put() needs at least one column; pass {name: tensor or RaggedTensor}")
    layouts = {}
    for name, d in described.items():
        layouts[name] = ColumnLayout.from_message({**d, "offset": 0})
        if layouts[name].rows != n:
            raise ColumnTypeError(f"column {name!r} holds {layouts[name].rows} rows but {n} rows are being written; "
                                  "give every column one value (or sequence) per row")
    return layouts


def _check_schema(storage: ArenaStorage, layouts: dict[str, ColumnLayout]) -> None:
    for name, lay in layouts.items():
        if not isinstance(name, str) or not name:
            raise ColumnTypeError(f"column names must be non-empty strings, got {name!r}")
        check_column_schema(name, storage.schema.get(name), lay.schema)


def _install_data_ops(host: DistributedHost, inst: _Instance) -> None:
    """put/get/state ops of one instance: the announce-then-transfer protocol (module docstring)."""
    server, storage, core = inst.server, inst.storage, inst.server.core
    link = host.link
    next_xfer = [0]

    def peer_of(a: dict[str, Any]) -> int:
        rank = a.get("rank")
        if not isinstance(rank, int) or rank < 0:
            raise InvalidRequestError("a data request must name the caller's rank; client and server versions differ")
        return rank

    async def hello(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        return {"server_rank": host.rank, "backend": host.backend, "name": inst.name}

    async def grant(sizes: list[int], owner: int, block: bool, timeout: float | None) -> list[int]:
        def attempt() -> list[int] | None:
            try:
                return storage.grant(sizes, owner)
            except ArenaFullError:
                if not block:
                    raise InvalidRequestError(
                        f"the store's arena has no room for {sum(sizes)} bytes now; acknowledge rows or raise arena_mb"
                    ) from None
                return None

        timeout = None if timeout is None else float(timeout)
        return await core.wait_until(
            attempt, timeout, lambda: f"waited {timeout}s for {sum(sizes)} bytes of arena; raise arena_mb")

    def finish_xfer(xid: int, *, abandon: bool, reuse: bool = True) -> None:
        x = inst.xfers.pop(xid, None)
        if x is None or not abandon:
            return
        if not reuse:  # a receive into these ranges may still be pending (its lane's kernels did not exit)
            _log.warning("distributed store: %d arena range(s) of an abandoned put are written off: a receive "
                         "into them did not end after its lane was aborted", len(x["offsets"]))
            return
        storage.abandon(x["offsets"])
        core.notify()

    async def lane_for(peer: int, a: dict[str, Any]) -> Lane | dict[str, Any]:
        """The formed lane to ``peer``, or the answer telling its client which lane to join first."""
        lane = link.serve_lane(peer, client_broken=a.get("lane_broken"), timeout_s=host.timeout_s)
        if lane.gen and a.get("lane") != lane.gen:
            return {"lane_needed": lane.describe()}
        await link.formed(lane, host.timeout_s)
        return lane

    async def put_begin(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        described: dict[str, Any] = a["columns"]
        n = int(a["n"])
        layouts = _layouts_from(described, n)
        _check_schema(storage, layouts)
        check_versions(a.get("versions"), n)
        rows: BatchMeta | None = a.get("rows")
        if rows is not None:
            ids = torch.as_tensor(rows.row_ids, dtype=torch.int64).reshape(-1)
            if ids.numel() != n:
                raise ColumnTypeError(f"columns hold {n} rows but rows names {ids.numel()}; give one value per row")
            core.controller.check_rows(ids)
        names = list(layouts)
        sizes = [layouts[k].nbytes for k in names]
        peer = peer_of(a)
        lane = None
        if peer != host.rank:  # before granting anything: an answer that only names a lane holds no arena
            lane = await lane_for(peer, a)
            if isinstance(lane, dict):
                return lane
        offsets = await grant(sizes, conn.id, bool(a.get("block", True)), a.get("timeout"))
        next_xfer[0] += 1
        xid = next_xfer[0]
        x = {"offsets": offsets, "names": names, "layouts": layouts, "conn": conn.id, "works": None, "lane": lane}
        inst.xfers[xid] = x
        if lane is None:
            return {"xfer": xid, "offsets": offsets}  # local: the client copies into the arena itself
        big, small_offsets, small_total = plan_messages(sizes)
        ops: list[tuple[str, torch.Tensor]] = []
        if small_total:
            staging = torch.empty(small_total, dtype=torch.uint8, device=host.device)
            x["staging"] = (staging, small_offsets)
            ops.append(("recv", staging))
        ops += [("recv", storage.mapping.tensor(offsets[i], sizes[i])) for i in big]
        if not ops:
            return {"xfer": xid, "seq": None, "lane": lane.gen}
        seq, issued = link.post(lane, ops)
        x["works"] = issued
        return {"xfer": xid, "seq": seq, "lane": lane.gen}

    async def put_end(conn: Connection, a: dict[str, Any]) -> BatchMeta:
        xid = int(a["xfer"])
        x = inst.xfers.get(xid)
        if x is None or x["conn"] != conn.id:
            raise InvalidRequestError(f"no put transfer {xid} of this client in flight")
        try:
            if x["works"] is not None:
                await link.wait(await x["works"], x["lane"], timeout_s=host.timeout_s)
            if "staging" in x:
                staging, small_offsets = x["staging"]
                sizes = [x["layouts"][k].nbytes for k in x["names"]]
                for i, off in small_offsets.items():
                    storage.mapping.tensor(x["offsets"][i], sizes[i]).copy_(staging[off : off + sizes[i]])
            if a.get("failed"):
                raise InvalidRequestError("the client abandoned this put")
            layouts: dict[str, ColumnLayout] = x["layouts"]
            n = next(iter(layouts.values())).rows
            _check_schema(storage, layouts)  # another put may have fixed a schema meanwhile
            versions = check_versions(a.get("versions"), n)
            rows: BatchMeta | None = a.get("rows")
            core.check_open()
            if rows is None:
                ids = await core.add_rows(n, a.get("partition", "default"), a.get("group_ids"),
                                          a.get("block", True), a.get("timeout"))
            else:
                ids = torch.as_tensor(rows.row_ids, dtype=torch.int64).reshape(-1)
                core.controller.check_rows(ids)
        except asyncio.CancelledError:
            raise  # the client's connection went away: gone() abandons the transfer once its receives ended
        except BaseException as exc:
            finish_xfer(xid, abandon=True, reuse=not memory_in_use(exc))
            raise
        extents = dict(zip(x["names"], x["offsets"], strict=True))
        for name, lay in layouts.items():
            lay.offset = extents[name]
        storage.write(ids, layouts, extents)
        finish_xfer(xid, abandon=False)
        core.mark_ready(ids, list(layouts), versions, a.get("num_tokens"))
        return BatchMeta(row_ids=ids, columns=tuple(layouts))

    async def get(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        names = list(a["columns"])
        peer = peer_of(a)
        lane = None
        if peer != host.rank:  # before pinning anything
            lane = await lane_for(peer, a)
            if isinstance(lane, dict):
                return lane
        located, pin = storage.locate(torch.as_tensor(a["row_ids"], dtype=torch.int64), names)
        try:
            described, sources = {}, []
            for name in names:
                d = located[name]
                src, counts = _column_bytes(storage.mapping, d)
                sources.append(src)
                described[name] = {"ragged": d["ragged"], "dtype": d["dtype"], "trailing": d["trailing"],
                                   "counts": counts, "nbytes": int(src.numel())}
        except BaseException:
            storage.unpin(pin)
            raise
        if lane is None:  # local: the reader copies the sources, then take_local unpins them
            next_xfer[0] += 1
            inst.xfers[next_xfer[0]] = {"sources": sources, "conn": conn.id, "pin": pin}
            return {"columns": described, "xfer": next_xfer[0]}
        sizes = [int(s.numel()) for s in sources]
        big, small_offsets, small_total = plan_messages(sizes)
        ops: list[tuple[str, torch.Tensor]] = []
        if small_total:
            staging = torch.empty(small_total, dtype=torch.uint8, device=host.device)
            for i, off in small_offsets.items():
                staging[off : off + sizes[i]].copy_(sources[i])
            ops.append(("send", staging))
        ops += [("send", sources[i]) for i in big]
        seq, issued = link.post(lane, ops) if ops else (None, None)

        async def unpin_when_sent() -> None:
            # a send only reads the arena, so the rows are unpinned even when its lane had to be aborted
            try:
                if issued is not None:
                    await link.wait(await issued, lane, timeout_s=host.timeout_s)
            finally:
                storage.unpin(pin)
                core.notify()  # arena space may be free again

        asyncio.ensure_future(unpin_when_sent())
        return {"columns": described, "seq": seq, "messages": len(ops), "lane": lane.gen}

    async def take_local(conn: Connection, a: dict[str, Any]) -> None:
        x = inst.xfers.pop(int(a["xfer"]), None)
        if x is not None and x["conn"] == conn.id:
            storage.unpin(x["pin"])
            core.notify()

    async def state_dict(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        return {"controller": core.controller.state_dict(), "storage": storage.state_dict()}

    async def load_state_dict(conn: Connection, a: dict[str, Any]) -> None:
        state = a["state"]
        if not isinstance(state, dict) or "controller" not in state or "storage" not in state:
            raise InvalidRequestError("not a store state_dict; pass what state_dict() returned")
        core.controller.load_state_dict(state["controller"])
        storage.load_state_dict(state["storage"])
        core.notify()

    async def open_store(conn: Connection, a: dict[str, Any]) -> dict[str, Any]:
        return await host.open(a.get("name"), dict(a.get("options") or {}))

    async def drop_store(conn: Connection, a: dict[str, Any]) -> None:
        if inst.private:  # closing the channel cancels this request: reply first, drop after
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(host.drop(inst.name)))

    def gone(conn: Connection) -> None:
        for xid, x in list(inst.xfers.items()):
            if x.get("conn") != conn.id:
                continue
            if "pin" in x:  # a local read that never finished
                inst.xfers.pop(xid, None)
                storage.unpin(x["pin"])
                continue
            if x.get("works") is None:
                finish_xfer(xid, abandon=True)
                continue

            async def abandon_after(xid: int = xid, x: dict[str, Any] = x) -> None:
                # the ranges are reused only once the receives into them ended: a dead gloo peer fails them;
                # a dead NCCL peer leaves them pending, so past a grace period the lane is aborted instead
                try:
                    works = await x["works"]
                except Exception:  # noqa: BLE001 - nothing was posted (the lane was already given up)
                    works = []
                ended = await link.settle_or_abort(works, x["lane"],
                                                   grace_s=min(ABANDON_GRACE_S, host.timeout_s))
                finish_xfer(xid, abandon=True, reuse=ended)

            asyncio.ensure_future(abandon_after())

    server.on_client_gone.append(gone)
    server.ops.update(hello=hello, put_begin=put_begin, put_end=put_end, get=get, take_local=take_local,
                      state_dict=state_dict, load_state_dict=load_state_dict, open_store=open_store,
                      drop_store=drop_store)


def _column_bytes(arena: DeviceArena, d: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A column's packed values as bytes (a view of the arena when its rows lie back to back) and per-row counts."""
    dtype = dtype_from_name(d["dtype"])
    elem = torch.empty((), dtype=dtype).element_size()
    per = int(torch.Size([int(x) for x in d["trailing"]]).numel())
    rb = elem * per
    loc: torch.Tensor = d["loc"]
    n = loc.shape[0]
    # counts travel in the reply: standard strides (a 1-row slice is "contiguous" with stride 3)
    starts, counts = loc[:, 1], loc[:, 2].clone(memory_format=torch.contiguous_format)
    total = int(counts.sum()) * rb if n else 0
    if total == 0:
        return torch.empty(0, dtype=torch.uint8, device=arena.bytes.device), counts
    if n == 1 or bool((starts[1:] == starts[:-1] + counts[:-1] * rb).all()):
        return arena.tensor(int(starts[0]), total), counts
    nbytes_per_row = counts * rb
    offs = torch.cumsum(nbytes_per_row, 0) - nbytes_per_row
    seg = torch.repeat_interleave(torch.arange(n), nbytes_per_row, output_size=total)
    idx = starts[seg] + (torch.arange(total, dtype=torch.int64) - offs[seg])
    return arena.bytes[idx.to(arena.bytes.device)], counts


# ====================================================================== the client


def _column_from(buf: torch.Tensor, d: dict[str, Any]) -> Column:
    dtype = dtype_from_name(d["dtype"])
    trailing = tuple(int(x) for x in d["trailing"])
    counts = torch.as_tensor(d["counts"], dtype=torch.int64)
    n = counts.numel()
    values = buf.view(dtype).reshape(-1, *trailing) if buf.numel() else torch.empty((0, *trailing), dtype=dtype,
                                                                                     device=buf.device)
    if d["ragged"]:
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return RaggedTensor(values, offsets)
    return values.reshape(n, *trailing)


class DistributedStore(RemoteStoreClient):
    """A StreamStore client on any rank of the process group (the server rank included).

    Build it through the plugin (``store: distributed``) or directly with
    ``DistributedStore(DistributedStoreConfig(...), group=...)``. On the server
    rank it starts the :class:`DistributedHost` when none runs and owns it
    (``close`` stops it); elsewhere it finds the host through the rendezvous
    store. Tensors returned by ``get`` live on the data-plane device: the CPU
    for gloo; for NCCL this rank's CUDA device, ``device`` (an index or
    ``"cuda:N"``), else ``LOCAL_RANK``, else the current device of the thread
    that builds the store (chosen here, once: the store's own threads would
    otherwise all be on device 0).
    """

    def __init__(self, config: DistributedStoreConfig | None = None, *, group: Any = None,
                 device: DeviceSpec = None) -> None:
        config = config or DistributedStoreConfig()
        ensure_process_group(config, device)
        super().__init__("", "")
        self.config = config
        self.group = group
        self.rank = dist.get_rank()
        self.server_rank = config.server_rank
        self.device = data_plane_device(str(dist.get_backend(group)), device)
        self.token_columns = tuple(config.token_columns)
        self.name: str | None = config.name
        self._host: DistributedHost | None = None
        if self.rank == self.server_rank and self.server_rank not in _HOSTS:
            self._host = DistributedHost.start(config, group, device=self.device)
        self._owns_instance = config.name is None
        self._resolve_lock = threading.Lock()
        self._resolved = False
        self._inflight: set[asyncio.Future] = set()

    @property
    def features(self) -> StoreFeatures:
        from asyncflow_core.store.deployments.features import DISTRIBUTED_FEATURES

        return DISTRIBUTED_FEATURES

    @property
    def link(self) -> P2PLink:
        return link_for(self.group, self.device)

    async def _data_call(self, op: str, **args: Any) -> tuple[Any, Lane | None]:
        """Call data op ``op``; when the server first names a lane to join (pair groups), join it and call again.

        Returns the reply and the lane its transfer uses (None for a local
        reply on the server rank). A lane this side gave up on is reported,
        so the server replaces its side too.
        """
        link = self.link
        for _ in range(_LANE_ATTEMPTS):
            held = link.client_lane(self.server_rank)
            reply = await self._call(op, **args, rank=self.rank,
                                     lane=held.gen if held is not None and held.broken is None else None,
                                     lane_broken=held.gen if held is not None and held.broken is not None else None)
            need = reply.get("lane_needed") if isinstance(reply, dict) else None
            if need is None:
                gen = reply.get("lane") if isinstance(reply, dict) else None
                if gen is None:
                    return reply, None
                if gen == 0:
                    return reply, link.shared_lane("use", self.server_rank)
                if held is None or held.gen != gen:
                    raise StoreClosedError(f"the server rank answered on lane {gen}, which this rank does not hold")
                return reply, held
            lane = link.join_lane(self.server_rank, int(need["gen"]), str(need["key"]),
                                  timeout_s=self.config.timeout_s)
            await link.formed(lane, self.config.timeout_s)
        raise StoreClosedError(f"the server rank {self.server_rank} replaced the data lane to rank {self.rank} "
                               f"{_LANE_ATTEMPTS} times in a row; is one of them restarting?")

    async def _find_host(self) -> tuple[str, str]:
        host = _HOSTS.get(self.server_rank)
        if host is not None:
            return host.address, host.token
        key = KEY_PREFIX + str(self.server_rank)
        timeout = timedelta(seconds=self.config.timeout_s)

        def lookup() -> bytes:
            kv = _kv_store()
            kv.wait([key], timeout)
            return kv.get(key)

        try:
            info = json.loads(await asyncio.to_thread(lookup))
        except Exception as exc:
            raise StoreClosedError(
                f"no distributed store host published by rank {self.server_rank} within {self.config.timeout_s}s; "
                "create the store on the server rank too (or start DistributedHost there)"
            ) from exc
        return info["address"], info["token"]

    async def _channel(self) -> ChannelClient:
        if not self._resolved and not self._closed:
            address, token = await self._find_host()
            probe = ChannelClient(address, token)
            await probe.connect()
            try:
                options = self.config.model_dump(mode="json")
                got = await probe.call("open_store", name=self.config.name, options=options)
            finally:
                await probe.close()
            self.address, self._token, self.name = got["address"], got["token"], got["name"]
            self._resolved = True
        return await super()._channel()

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
        payloads: list[torch.Tensor] = []
        described: dict[str, dict[str, Any]] = {}
        for name, col in columns.items():
            values, lengths = split_column(name, col, n)
            values = values.detach().to(self.device).contiguous()
            payloads.append(_flat(values))
            described[name] = {"ragged": lengths is not None, "dtype": dtype_name(values.dtype),
                               "trailing": list(values.shape[1:]), "rows": n,
                               "lengths": None if lengths is None else lengths.cpu()}
        if group_ids is not None:
            group_ids = torch.as_tensor(group_ids, dtype=torch.int64).reshape(-1)
        check_versions(versions, n)
        tokens = num_tokens_of(columns, self.token_columns)
        await self._channel()
        begun, lane = await self._data_call("put_begin", columns=described, n=n, rows=rows, versions=versions,
                                            block=block, timeout=timeout)
        # From here the transfer is committed: finish it even if the caller is cancelled.
        rest = {"rows": rows, "partition": partition, "group_ids": group_ids, "versions": versions, "block": block,
                "timeout": timeout, "num_tokens": tokens}
        task = asyncio.ensure_future(self._put_rest(begun, lane, payloads, rest))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def _put_rest(self, begun: dict[str, Any], lane: Lane | None, payloads: list[torch.Tensor],
                        kw: dict[str, Any]) -> BatchMeta:
        xid = begun["xfer"]
        if lane is None:  # local path: same process as the host
            arena = _HOSTS[self.server_rank].instances[self.name].storage.mapping  # type: ignore[index]
            failed = False
            try:
                for off, src in zip(begun["offsets"], payloads, strict=True):
                    if src.numel():
                        arena.tensor(off, src.numel()).copy_(src)
            except BaseException:
                failed = True
                raise
            finally:
                if failed:
                    with contextlib.suppress(Exception):
                        await self._call("put_end", xfer=xid, failed=True)
            return await self._call("put_end", xfer=xid, **kw)
        sizes = [int(p.numel()) for p in payloads]
        big, small_offsets, small_total = plan_messages(sizes)
        ops: list[tuple[str, torch.Tensor]] = []
        if small_total:
            staging = torch.empty(small_total, dtype=torch.uint8, device=self.device)
            for i, off in small_offsets.items():
                staging[off : off + sizes[i]].copy_(payloads[i])
            ops.append(("send", staging))
        ops += [("send", payloads[i]) for i in big]
        issued = self.link.post_at(lane, int(begun["seq"]), ops) if ops else None
        end = asyncio.ensure_future(self._call("put_end", xfer=xid, **kw))  # pipelined with the data
        try:
            if issued is not None:
                await self.link.wait(await issued, lane, timeout_s=self.config.timeout_s)
        finally:
            result = await end
        return result

    # -- get -----------------------------------------------------------------------

    async def get(self, meta: BatchMeta, columns: Any = None) -> Batch:
        names = list(meta.columns if columns is None else columns)
        await self._channel()
        reply, lane = await self._data_call("get", row_ids=meta.row_ids, columns=names)
        task = asyncio.ensure_future(self._get_rest(reply, lane, names))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        cols = await asyncio.shield(task)
        return Batch(cols, row_ids=meta.row_ids, num_rows=len(meta))

    async def _get_rest(self, reply: dict[str, Any], lane: Lane | None, names: list[str]) -> dict[str, Column]:
        described = reply["columns"]
        sizes = [int(described[n]["nbytes"]) for n in names]
        if lane is None:  # local path: copy out of the arena
            inst = _HOSTS[self.server_rank].instances[self.name]  # type: ignore[index]
            try:
                sources = inst.xfers[int(reply["xfer"])]["sources"]
                bufs = [s.to(self.device, copy=True) for s in sources]
            finally:
                await self._call("take_local", xfer=int(reply["xfer"]))
            return {n: _column_from(b, described[n]) for n, b in zip(names, bufs, strict=True)}
        big, small_offsets, small_total = plan_messages(sizes)
        bufs: dict[int, torch.Tensor] = {}
        ops: list[tuple[str, torch.Tensor]] = []
        if small_total:
            staging = torch.empty(small_total, dtype=torch.uint8, device=self.device)
            ops.append(("recv", staging))
            for i, off in small_offsets.items():
                bufs[i] = staging[off : off + sizes[i]]
        for i in big:
            bufs[i] = torch.empty(sizes[i], dtype=torch.uint8, device=self.device)
            ops.append(("recv", bufs[i]))
        if ops:
            works = await self.link.post_at(lane, int(reply["seq"]), ops)
            await self.link.wait(works, lane, timeout_s=self.config.timeout_s)
        out = {}
        for i, n in enumerate(names):
            buf = bufs.get(i, torch.empty(0, dtype=torch.uint8, device=self.device))
            out[n] = _column_from(buf, described[n])
        return out

    async def close(self) -> None:
        if self._closed:
            return
        if self._inflight:  # committed transfers finish first: the peer counts on them
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        if self._owns_instance and self._resolved and self._conn is not None:
            with contextlib.suppress(Exception):
                await self._call("drop_store")
        self._closed = True
        await self._close_channel()
        if self._host is not None:
            await asyncio.to_thread(self._host.stop)
            self._host = None


def open_distributed_store(config: DistributedStoreConfig, group: Any = None) -> DistributedStore:
    """Factory used by the plugin: initialises the process group if asked, then builds the client."""
    device = config.device
    if device is not None and device.isdigit():
        device = int(device)
    return DistributedStore(config, group=group, device=device)


__all__ = ["DistributedHost", "DistributedStore", "P2PLink", "data_plane_device", "init_loopback_process_group",
           "link_for", "open_distributed_store", "plan_messages"]


_LOOPBACK_LISTENERS: list[int] = []  # the master's listening fds, open for the life of the process


def init_loopback_process_group(rank: int, world_size: int, port: int, *, backend: str = "gloo",
                                timeout_s: float = 120.0, device: DeviceSpec = None) -> torch.device:
    """Join a torch.distributed group whose rendezvous listens on 127.0.0.1 only (single-host runs and tests).

    ``init_method="tcp://127.0.0.1:PORT"`` makes rank 0's TCPStore listen on
    every interface; here rank 0 binds the listening socket to loopback itself
    and hands it to the store (``master_listen_fd``), and gloo's own sockets
    use the loopback interface (``GLOO_SOCKET_IFNAME=lo`` unless already set;
    for NCCL also ``NCCL_SOCKET_IFNAME=lo``).

    ``backend="nccl"``: this rank's CUDA device (``device``, else
    ``LOCAL_RANK``, else the calling thread's current device) is made the
    calling thread's current device *before* the group forms and is passed
    as ``device_id`` (torch 2.13: binds the group to it and creates the
    communicator at once). Returns the data-plane device (the CPU for gloo).
    """
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    cuda = resolve_cuda_device(device) if "nccl" in backend else None
    if cuda is not None:
        use_device(cuda)

    if "lo" in {name for _, name in socket.if_nameindex()}:  # gloo's own pair sockets on loopback too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if "nccl" in backend:  # and NCCL's bootstrap sockets (it reads this once, at its first communicator)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        # the store's daemon thread polls this fd until the process ends: detach it so Python never closes it
        # under the daemon at interpreter exit (which aborts the process with "unexpected poll revent")
        fd = listener.detach()
        _LOOPBACK_LISTENERS.append(fd)
        store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timeout,
                              master_listen_fd=fd, use_libuv=False)
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout, use_libuv=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=cuda)
    return cuda if cuda is not None else torch.device("cpu")
