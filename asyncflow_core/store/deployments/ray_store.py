"""The ray deployment: a controller actor, storage-unit actors, and column data in Ray's object store.

Actors:

- **controller**: an *async* actor serving a :class:`StoreCore` (the same
  control core the multiprocess server runs). A blocking ``get_meta`` or a
  ``put`` waiting for capacity awaits the core's asyncio notification inside
  the actor (``max_concurrency`` sized for many waiters); nothing polls. Lease
  deadlines are on the controller actor's monotonic clock. It also keeps the
  data index: for each (row, column), the object of Ray's object store holding
  the value and the row's position in it. It holds references, never bytes.
- **storage units** (``num_storage_units``, taking puts in turn): plain actors
  that keep a producer's object mapped, so a row's data outlives the process
  that put it, and serve arena ranges of their node to readers on other nodes.

Data path. Column values travel as numpy arrays (torch tensors viewed, no
copy), never through pickle:

- put is **one call** to the controller. A payload above :data:`INLINE_BYTES`
  is copied (**one warm copy**) into the producer's shared-memory arena when a
  storage unit runs on the producer's node (:mod:`.ray_arena`: it says why a
  ``ray.put`` costs several times more, and how ranges are recycled); the
  controller indexes the range and answers with ranges of that arena it no
  longer needs. Otherwise it is ``ray.put`` by the producer (**one copy**) and
  passed by reference; a storage unit maps the object at once and keeps it
  mapped, so the rows outlive the producer. Either way the ready bits are set
  only once the data is stored. A small payload travels inside the call and
  the controller puts it itself.
- get is **one call** to the controller, which answers with each column's
  ranges or objects and row positions (and pins the ranges for this reader);
  the client maps them zero-copy (a reader on another node gets a range from
  the unit on its node, an object from Ray, one copy) and returns **views**
  when the rows are one run of one put (the common case), else one gather
  copy. A batch is read-only memory shared with the store: it keeps its
  values for as long as it is referenced (the object or range stays pinned),
  and must not be written in place (clone first).

A loop of put, get_meta, get and ack is two round trips to the controller on one node:

- get_meta answers with the lease's locations too (pinned, as a get's locate would), and the controller's
  *epoch*, a count of stored values replaced or freed that it keeps in a shared-memory file on its node. A get
  on that node reads those locations, without a call, while the file still holds that count; otherwise (a value
  was rewritten or freed since, the controller is on another node, a second get of the meta) it asks again.
  A meta dropped unread releases its pins with the handle's next call.
- an ack of a lease the handle got and still holds (with at least :data:`_ACK_MARGIN_S` left) is sent without
  waiting for the reply. The controller applies a handle's acks in order and before any later call of that
  handle; an ack that fails there after all (another handle declared its consumer dead or cleared its rows
  meanwhile, or it arrived after the deadline) makes the handle's next call to the controller raise its error
  and do nothing, and ``close`` raises it after closing. Any other ack (a second one, an unknown lease, one
  near its deadline) waits and raises at once. Another handle sees an ack applied once the acking handle made
  a later call or closed.

The controller drops its references when a row is collected after its last
ack, or cleared; Ray frees an object once no row and no reader uses it, and a
range goes back to its producer once no row and no reader uses it.

Start Ray first: this store never starts a cluster on its own (a cluster is a
process-wide choice of addresses, resources and namespace). For one host,
:func:`init_local_ray` starts Ray bound to 127.0.0.1 only and checks it. A
store created with a ``name`` can be joined by other drivers and actors
(``RayStore.join(name, namespace)``, or pass the store object to a Ray task:
it arrives as a joined handle). ``close()`` of the creating handle closes the
store and kills its actors; a joined handle only stops using it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.store.deployments import ray_arena
from asyncflow_core.store.deployments.core import StoreCore, check_versions, num_tokens_of, rows_of
from asyncflow_core.store.deployments.features import RAY_FEATURES
from asyncflow_core.store.deployments.ray_arena import ArenaReader, ProducerArena, RangeRecycledError
from asyncflow_core.store.errors import (
    ColumnTypeError,
    InvalidRequestError,
    StoreClosedError,
    StoreError,
)
from asyncflow_core.store.storage import ColumnSchema, StorageUnit, check_column_schema
from asyncflow_core.types import Batch, Column, RaggedTensor

try:
    import ray
except ImportError as _exc:  # pragma: no cover - exercised only without ray
    raise ImportError("the ray store deployment needs Ray: pip install 'asyncflow[ray]'") from _exc

INLINE_BYTES = 100 << 10  #: payloads above this are ray.put by the producer and copied by a storage unit
MAX_CONCURRENCY = 10_000  #: concurrent calls (mostly blocked waiters) the controller actor serves
_UNPINS_REMEMBERED = 65536  #: unpins a storage unit remembers, for pins that arrive after them
_UNPIN_DELAY_S = 0.01  #: how long the controller gathers unpins before it sends them to the units
_THREAD_PUT_BYTES = 8 << 20  #: larger ray.put copies run off the event loop thread
_READ_TRIES = 5  #: a get locates rows again when a range was recycled while read (its column rewritten)
_ACK_MARGIN_S = 1.0  #: an ack is sent without waiting only while its lease has at least this long left
_LEASES_REMEMBERED = 65536  #: leases a handle remembers (those it got and has not ended), for acks not awaited

# numpy has no bfloat16 / float8: such tensors travel as raw bytes with their torch dtype name
_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}


# ====================================================================== Ray start


def init_local_ray(num_cpus: int = 2, **kwargs: Any) -> None:
    """Start a single-host Ray bound to 127.0.0.1 only, and check that it is (``ConfigError`` if not).

    Does nothing but the check when Ray is already initialised. Extra keyword
    arguments go to :func:`ray.init` (``_node_ip_address`` and
    ``include_dashboard`` are fixed: loopback, no dashboard).
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # inherited by Ray's processes
    if not ray.is_initialized():
        # Ray reads that variable once, at import, and otherwise turns _node_ip_address="127.0.0.1" into the
        # host's routable IP and binds every server to all interfaces. ray is imported by now, so set the
        # constant it became as well; the checks below catch a Ray version where this no longer holds.
        from ray._private import ray_constants

        if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] in ("0", "false", "False"):
            ray_constants.ENABLE_RAY_CLUSTER = False
        kwargs.setdefault("log_to_driver", False)
        kwargs.setdefault("logging_level", "ERROR")
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
    bad = [n.get("NodeManagerAddress") for n in ray.nodes() if n.get("NodeManagerAddress") != "127.0.0.1"]
    if bad or ray.util.get_node_ip_address() != "127.0.0.1":
        raise ConfigError(
            f"Ray is bound to {bad or ray.util.get_node_ip_address()}, not 127.0.0.1: init_local_ray() wants a "
            "loopback-only single-host Ray; shut the running Ray down first, or use ray.init() for a real cluster"
        )
    public = [a for a in ray_listening_addresses() if not _is_loopback(a[0])]
    if public:
        raise ConfigError(f"Ray processes listen on non-loopback addresses {public}; refusing to use this Ray")


def ray_listening_addresses() -> list[tuple[str, int, int]]:
    """``(ip, port, pid)`` of every TCP socket listened on by this process and its descendants (Linux /proc).

    The local Ray's processes (GCS, raylet, agents, workers) are all
    descendants of the driver that started it. Empty where /proc is missing.
    """
    if not os.path.isdir("/proc/self/fd"):
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    pids, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid not in pids:
            pids.add(pid)
            todo.extend(children.get(pid, []))
    listening: dict[int, tuple[str, int]] = {}  # socket inode -> (ip, port)
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A":  # TCP_LISTEN
                ip_hex, port_hex = parts[1].split(":")
                listening[int(parts[9])] = (_proc_ip(ip_hex, v6), int(port_hex, 16))
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listening:
                    out.append((*listening[inode], pid))
    return sorted(set(out))


def _proc_ip(hex_ip: str, v6: bool) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_ip)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # four little-endian 32-bit words
    addr = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(addr.ipv4_mapped or addr)


def _is_loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip).is_loopback


def _require_ray() -> None:
    if not ray.is_initialized():
        raise ConfigError(
            "the ray store needs a running Ray: call ray.init(...) (joining your cluster) before creating it, or "
            "asyncflow_core.store.deployments.ray_store.init_local_ray() for a loopback-only single-host Ray"
        )


# ====================================================================== wire format (numpy, out-of-band)


def _to_wire(t: torch.Tensor) -> tuple[np.ndarray, str | None, tuple[int, ...]]:
    t = t.detach().cpu().contiguous()
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy(), None, tuple(t.shape)
    return t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _from_wire(w: tuple[np.ndarray, str | None, tuple[int, ...]]) -> torch.Tensor:
    """A tensor over the array's memory (no copy; read from the object store, it is read-only by contract)."""
    arr, dtype, shape = w
    with warnings.catch_warnings():  # a value read from the object store is a read-only buffer
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr) if arr.size else torch.from_numpy(np.array(arr))
    if dtype is not None:
        t = t.view(getattr(torch, dtype)).reshape(shape)
    return t


def _column_to_wire(col: Column) -> dict[str, Any]:
    if isinstance(col, RaggedTensor):
        return {"v": _to_wire(col.values), "o": _to_wire(col.offsets)}
    return {"v": _to_wire(col)}


def _column_from_wire(w: dict[str, Any]) -> Column:
    values = _from_wire(w["v"])
    return RaggedTensor(values, _from_wire(w["o"])) if "o" in w else values


def _wire_nbytes(w: dict[str, Any]) -> int:
    return sum(int(p[0].nbytes) for p in w.values())


# Control values cross the actor boundary as numpy arrays: Ray pickles a torch tensor through torch.save
# (about 0.2 ms each, 1.2 ms for a lease's BatchMeta here), a numpy array out of band (about 0.02 ms).
_META_TENSORS = ("row_ids", "group_ids", "min_version", "max_version", "num_tokens")


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else torch.as_tensor(t).detach().cpu().contiguous().numpy()


def _pt(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.array(a))  # an own, writable copy (control data is small)


def _meta_out(meta: Any) -> Any:
    """A :class:`BatchMeta` as a dict of plain values and numpy arrays (anything else passes unchanged)."""
    if not isinstance(meta, BatchMeta):
        return meta
    d = {f.name: getattr(meta, f.name) for f in dataclasses.fields(BatchMeta)}
    for k in _META_TENSORS:
        d[k] = _np(d[k])
    return d


def _meta_in(d: Any) -> Any:
    """The inverse of :func:`_meta_out`."""
    if not isinstance(d, dict):
        return d
    d = dict(d)
    for k in _META_TENSORS:
        d[k] = _pt(d[k])
    return BatchMeta(**d)


def _empty_column(schema: tuple[bool, str, tuple[int, ...]]) -> Column:
    s = _schema(schema)
    return RaggedTensor.empty(s.dtype, s.trailing) if s.ragged else torch.empty((0, *s.trailing), dtype=s.dtype)


def _assemble(loc: torch.Tensor, columns: dict[int, Column]) -> Column:
    """A column of rows at ``loc`` ([n, 2]: object id, row position in it) from the objects' columns, in order.

    One run of one object (rows read as one put wrote them) is a view; anything else is one gather per object
    and a reorder."""
    obj, pos = loc[:, 0], loc[:, 1]
    n = int(loc.shape[0])
    first = int(obj[0])
    p0 = int(pos[0])
    if bool((obj == first).all()) and (n == 1 or bool((pos[1:] - pos[:-1] == 1).all())):
        return columns[first][p0 : p0 + n]
    picks, parts = [], []
    for k in torch.unique(obj).tolist():
        idx = (obj == k).nonzero().squeeze(1)
        col = columns[k]
        picks.append(idx)
        parts.append(col.select(pos[idx]) if isinstance(col, RaggedTensor) else col[pos[idx]])
    order = torch.argsort(torch.cat(picks))  # meta position -> position in the concatenated parts
    if isinstance(parts[0], RaggedTensor):
        return RaggedTensor.cat(parts).select(order)
    return torch.cat(parts)[order]


# ====================================================================== the data index


class _ObjectIndex:
    """Where each (row, column) value lies: an object of Ray's object store and the row's position in it.

    The positions are a plain :class:`StorageUnit` of int64 ``[n, 2]`` dense columns (object id, position), so
    row-table bookkeeping is reused. An object is dropped (its reference released) once no row uses it.
    """

    def __init__(self, on_drop: Any = None, on_change: Any = None) -> None:
        self.where = StorageUnit()
        #: how many times values already indexed were replaced or freed (locations handed out may be stale)
        self.changes = 0
        self.on_change = on_change or (lambda changes: None)
        #: id -> [reference, (row, column) values in it, bytes, (unit, key) of the storage unit pinning it or None]
        self.objects: dict[int, list[Any]] = {}
        self.on_drop = on_drop or (lambda obj, unit: None)
        self._next = 0

    def new_id(self) -> int:
        self._next += 1
        return self._next

    def add(self, obj: int, ref: Any, nbytes: int, pin: tuple[int, str] | None = None) -> int:
        self.objects[obj] = [ref, 0, int(nbytes), pin]
        return obj

    def write(self, row_ids: torch.Tensor, positions: torch.Tensor, columns: Sequence[str], obj: int) -> None:
        """Point ``columns`` of ``row_ids`` at rows ``positions`` of object ``obj`` (replacing older values)."""
        if row_ids.numel():
            for name in columns:
                self._unref(row_ids, name)
            loc = torch.stack([torch.full_like(row_ids, obj), positions], dim=1)
            self.where.write(row_ids, {name: loc for name in columns})
            self.objects[obj][1] += int(row_ids.numel()) * len(columns)
        self._maybe_drop(obj)

    def locate(self, row_ids: torch.Tensor, columns: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[int, Any]]:
        """Per column the ``[n, 2]`` locations, and per object they name its (reference, pinning unit).

        ``UnknownColumnError`` / ``UnknownRowError`` (from the index) for a column never written or a row
        without a value."""
        located = self.where.read(row_ids, list(columns))
        out = {name: located[name] for name in columns}
        used = torch.unique(torch.cat([loc[:, 0] for loc in out.values()])) if out and row_ids.numel() else None
        refs = {} if used is None else {k: (self.objects[k][0], self.objects[k][3]) for k in used.tolist()}
        return out, refs

    def free(self, row_ids: torch.Tensor) -> None:
        for name in self.where.schema:
            self._unref(row_ids, name)
        self.where.free(row_ids)

    def clear(self) -> None:
        for obj, entry in self.objects.items():
            self.on_drop(obj, entry[3])
        self.where = StorageUnit()
        self.objects.clear()
        self._changed()

    def _changed(self) -> None:
        self.changes += 1
        self.on_change(self.changes)

    @property
    def nbytes(self) -> int:
        return sum(o[2] for o in self.objects.values())

    def _unref(self, row_ids: torch.Tensor, name: str) -> None:
        if name not in self.where.schema or row_ids.numel() == 0:
            return
        has = self.where.has(row_ids, name)
        if not bool(has.any()):
            return
        self._changed()
        loc = self.where.read(row_ids[has], [name])[name]
        objs, counts = torch.unique(loc[:, 0], return_counts=True)
        for k, c in zip(objs.tolist(), counts.tolist(), strict=True):
            self.objects[k][1] -= c
            self._maybe_drop(k)

    def _maybe_drop(self, obj: int) -> None:
        entry = self.objects.get(obj)
        if entry is not None and entry[1] <= 0:
            del self.objects[obj]  # the last reference the store holds: Ray frees it once no reader pins it
            self.on_drop(obj, entry[3])


# ====================================================================== the actors


class _Caller:
    """A handle's acks not awaited, at the controller: how many were applied, and the errors not yet reported."""

    __slots__ = ("done", "errors", "cond")

    def __init__(self) -> None:
        self.done = 0
        self.errors: list[BaseException] = []
        self.cond: asyncio.Condition | None = None

    async def reach(self, seq: int) -> None:
        if self.done < seq:
            if self.cond is None:
                self.cond = asyncio.Condition()
            async with self.cond:
                await self.cond.wait_for(lambda: self.done >= seq)

    async def applied(self, seq: int) -> None:
        self.done = max(self.done, seq)
        if self.cond is not None:
            async with self.cond:
                self.cond.notify_all()


def _ordered(method: Any) -> Any:
    """A controller method that a handle's earlier acks (sent without waiting) come before: ``_after=(caller,
    seq)`` waits until that caller's acks up to ``seq`` are applied, and raises the first error one of them met
    (each such error is raised once, by the caller's next call, which then does nothing). ``_unpins``: arena
    ranges the caller's readers are done with, carried by the call (see :meth:`_ControllerActor.unpin_ranges`)."""

    async def call(self: Any, *args: Any, _after: tuple[str, int] | None = None,
                   _unpins: list[tuple[str, int]] = (), **kwargs: Any) -> Any:
        if _unpins:
            await self.unpin_ranges(_unpins)
        if _after is not None:
            await self._after_acks(*_after)
        return await method(self, *args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return call


class _StorageUnitActor:
    """Keeps the payloads of puts mapped (zero-copy, from the producers' objects) until the controller drops them.

    Ray frees an object when its owner, the producer's process, exits; memory a process still maps stays
    valid. So a unit holding each payload keeps the rows' data after the producer is gone, without a copy, and
    serves it (:meth:`read`) to a reader that finds the producer's object lost.
    """

    def __init__(self) -> None:
        self.pinned: dict[str, dict[str, Any]] = {}  #: object key (its reference's hex id) -> payload
        #: keys unpinned before their pin arrived (the pin comes from the producer, the unpin from the
        #: controller: no order between them), so a late pin is not kept
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        ray_arena.sweep_dead_arenas()  # arena directories of stores whose units were killed on this host

    def pin(self, key: str, payload: dict[str, Any]) -> bool:
        if key in self._gone:
            del self._gone[key]
            return True
        self.pinned[key] = payload  # arrays over the object store's memory: nothing is copied
        return True

    def read(self, key: str) -> dict[str, Any]:
        payload = self.pinned.get(key)
        if payload is None:
            raise StoreClosedError("the rows' data is gone: its producer exited and no storage unit holds it")
        return payload

    def unpin(self, keys: list[str]) -> None:
        for key in keys:
            if self.pinned.pop(key, None) is None:
                self._gone[key] = None
        while len(self._gone) > _UNPINS_REMEMBERED:
            self._gone.popitem(last=False)

    def ping(self) -> bool:
        return True

    def node(self) -> tuple[str, int]:
        """The Ray node this unit runs on (a producer on it may put through a shared-memory arena), and the
        unit's pid, which names the store's arena directory there."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def read_range(self, desc: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
        """An arena range of this node as wire columns, for a reader on another node (one copy)."""
        if not hasattr(self, "_reader"):
            self._reader = ArenaReader()
        try:
            return ray_arena.read_range(self._reader, desc, names)
        except RangeRecycledError:
            return {}  # recycled meanwhile: the reader locates the rows again

    def remove_arenas(self, store_key: str) -> None:
        """Delete the store's arena files on this node (the store is closing)."""
        if hasattr(self, "_reader"):
            self._reader.close()
        ray_arena.remove_store_dir(store_key, os.getpid())


class _ControllerActor:
    """An async actor serving a :class:`StoreCore`; also keeps column schemas and the data index."""

    def __init__(self, options: dict[str, Any], units: list[Any], token_columns: tuple[str, ...]) -> None:
        from asyncflow_core.store.options import StoreOptions

        self.core = StoreCore(StoreOptions(**options).controller(), on_drop=self._free_data)
        self.units = units
        self.token_columns = tuple(token_columns)
        self.schema: dict[str, tuple[bool, str, tuple[int, ...]]] = {}  # name -> (ragged, dtype, trailing)
        self.data = _ObjectIndex(on_drop=self._unpin, on_change=self._publish)
        self._epoch: ray_arena.Epoch | None = None  # self.data.changes in shared memory (see get_meta)
        self._epoch_tried = False
        self._unpins: dict[int, list[str]] = {}  # unit -> keys to unpin, sent after the call that freed them
        #: producer arena id -> its ranges no row uses any more, returned with that producer's next put
        self._freed: dict[str, list[tuple[int, int, int]]] = {}
        self._range_pins: collections.Counter[tuple[str, int]] = collections.Counter()  # (arena, seq) -> readers
        self._range_dropped: dict[tuple[str, int], dict[str, Any]] = {}  # no row uses them; pinned by readers
        self._callers: dict[str, _Caller] = {}  # handle -> its acks sent without waiting (ack_after)

    def _unpin(self, obj: int, pin: Any) -> None:
        if isinstance(pin, dict):  # an arena range: back to its producer with its next put reply, once unpinned
            key = (pin["arena"], pin["seq"])
            if self._range_pins[key] > 0:
                self._range_dropped[key] = pin
            else:
                self._freed.setdefault(pin["arena"], []).append((pin["file"], pin["offset"], pin["nbytes"]))
            return
        if pin is None:
            return
        if not self._unpins:
            # sent a moment after the call that collected the rows has answered (a task submission costs about a
            # millisecond that an ack would otherwise wait for), batched with whatever else is freed meanwhile
            asyncio.get_running_loop().call_later(_UNPIN_DELAY_S, self._send_unpins)
        self._unpins.setdefault(pin[0], []).append(pin[1])

    def _send_unpins(self) -> None:
        batches, self._unpins = self._unpins, {}
        for unit, keys in batches.items():
            self.units[unit].unpin.remote(keys)  # fire and forget

    async def info(self) -> dict[str, Any]:
        return {"units": self.units, "token_columns": self.token_columns}

    def _publish(self, changes: int) -> None:
        if self._epoch is not None:
            self._epoch.set(changes)

    def _epoch_file(self) -> ray_arena.Epoch | None:
        """The shared-memory copy of ``data.changes`` on this node, made at the first get_meta that asks (None
        where it cannot be made: no /dev/shm)."""
        if self._epoch is None and not self._epoch_tried:
            self._epoch_tried = True
            ctx = ray.get_runtime_context()
            path = os.path.join(ray_arena.store_dir(ctx.get_actor_id(), os.getpid()), "epoch")
            try:
                self._epoch = ray_arena.Epoch(path, create=True)
                self._epoch.set(self.data.changes)
            except OSError:
                self._epoch = None
            else:
                self._epoch_at = (path, ctx.get_node_id())
        return self._epoch

    async def _after_acks(self, caller: str, seq: int) -> None:
        state = self._callers.setdefault(caller, _Caller())
        await state.reach(seq)
        if state.errors:
            exc = state.errors.pop(0)
            try:
                again = type(exc)(f"an earlier ack on this store handle failed: {exc}")
            except Exception:  # noqa: BLE001  (an error type that takes other arguments: as it was)
                again = exc
            raise again from None

    async def ack_after(self, meta: dict[str, Any], caller: str, seq: int, unpins: list[tuple[str, int]] = ()) -> None:
        """An ack its handle does not wait for (its ``seq``-th): applied after the handle's earlier ones and before
        its later calls (:func:`_ordered`); an error is kept for the handle's next call, never raised here."""
        await self.unpin_ranges(unpins)
        state = self._callers.setdefault(caller, _Caller())
        await state.reach(seq - 1)
        try:
            self.core.ack(_meta_in(meta))
        except Exception as exc:  # noqa: BLE001  (reported by the caller's next call)
            state.errors.append(exc)
        await state.applied(seq)

    @_ordered
    async def settle(self, caller: str) -> None:
        """Nothing, once the caller's acks are applied (their error, if any, raised); the caller is forgotten."""
        self._callers.pop(caller, None)

    def _pin_ranges(self, refs: Any) -> list[tuple[str, int]]:
        keys = [(d["arena"], d["seq"]) for d in refs if isinstance(d, dict)]
        self._range_pins.update(keys)
        return keys

    async def unpin_ranges(self, keys: list[tuple[str, int]]) -> None:
        """Readers are done with these arena ranges (one call per pin a ``locate`` took)."""
        for key in keys:
            key = tuple(key)
            self._range_pins[key] -= 1
            if self._range_pins[key] <= 0:
                del self._range_pins[key]
                pin = self._range_dropped.pop(key, None)
                if pin is not None:
                    self._unpin(0, pin)

    def _free_data(self, row_ids: torch.Tensor) -> None:
        self.data.free(row_ids)

    def _drop_rows(self, row_ids: torch.Tensor) -> None:
        """Drop rows a put allocated but did not complete (they have no ready bit, so nobody leased them)."""
        if self.core.controller.drop_rows(row_ids).numel():
            self.core.notify()

    def _check_schema(self, schema: dict[str, tuple[bool, str, tuple[int, ...]]]) -> None:
        for name, got in schema.items():
            want = self.schema.get(name)
            if want is not None:
                check_column_schema(name, _schema(want), _schema(got))

    # -- put / get ---------------------------------------------------------------

    @_ordered
    async def put(
        self, schema: dict[str, Any], n: int, row_ids: torch.Tensor | None, partition: str, group_ids: Any,
        block: bool, timeout: float | None, payload: tuple[Any, ...], nbytes: int, versions: Any,
        num_tokens: Any, unpins: list[tuple[str, int]] = (),
    ) -> Any:
        """The whole put: schema check, new row ids (waiting for capacity) or a check that ``row_ids`` are live,
        the data indexed (``payload``: ``("inline", wire)``, ``("ref", [reference], unit)`` or ``("arena",
        range)``), the ready bits. Row ids, group ids, versions and token counts arrive and leave as numpy arrays;
        an arena put answers ``(row ids, ranges of that arena no row uses any more)``."""
        row_ids, group_ids, versions, num_tokens = _pt(row_ids), _pt(group_ids), _pt(versions), _pt(num_tokens)
        await self.unpin_ranges(unpins)  # this handle's readers' finished ranges, carried by the call
        self.core.check_open()
        self._check_schema(schema)
        new = row_ids is None
        if new:
            ids = await self.core.add_rows(n, partition, group_ids, block, timeout)
        else:
            self.core.controller.check_rows(row_ids)
            ids = row_ids
        try:
            self._check_schema(schema)  # another put may have fixed a schema while this one waited
            for name, s in schema.items():
                self.schema.setdefault(name, tuple(s))
            if payload[0] == "inline":
                ref, pin = ray.put(payload[1]), None  # small: this actor's own copy
            elif payload[0] == "arena":  # in the producer's shared-memory arena: indexed by its description
                ref = pin = payload[1]
            else:  # ("ref", [reference], unit): the producer has that unit pin it meanwhile
                ref = payload[1][0]
                pin = (int(payload[2]), ref.hex())
        except BaseException:
            if new:
                self._drop_rows(ids)
            raise
        # no await since the rows were allocated or checked: they are all live, and indexed with their ready bits
        # in one step (the data is in the object store already)
        obj = self.data.add(self.data.new_id(), ref, nbytes, pin)
        self.data.write(ids, torch.arange(n, dtype=torch.int64), list(schema), obj)
        if ids.numel():
            self.core.mark_ready(ids, list(schema), versions, num_tokens)
        if payload[0] == "arena":
            return _np(ids), self._freed.pop(payload[1]["arena"], [])
        return _np(ids)

    @_ordered
    async def locate(self, row_ids: np.ndarray, columns: list[str],
                     unpins: list[tuple[str, int]] = ()) -> dict[str, Any]:
        """Where ``columns`` of ``row_ids`` lie: per column its schema and ``[n, 2]`` locations, and the objects
        (arena ranges named are pinned for the reader; ``unpins``: ranges it is done with)."""
        await self.unpin_ranges(unpins)
        row_ids = _pt(row_ids)
        self.core.check_open()
        for name in columns:
            if name not in self.schema:
                from asyncflow_core.store.errors import UnknownColumnError

                raise UnknownColumnError(f"column {name!r} was never written; written columns: {sorted(self.schema)}")
        return self._locate(row_ids, columns)

    def _locate(self, row_ids: torch.Tensor, columns: list[str]) -> dict[str, Any]:
        located, refs = self.data.locate(row_ids, columns)
        self._pin_ranges(ref for ref, _ in refs.values())  # the reader unpins them when its batch is gone
        # nested in lists: the references travel, not the values
        return {"schema": {k: self.schema[k] for k in columns}, "loc": {k: _np(v) for k, v in located.items()},
                "objects": {k: ref if isinstance(ref, dict) else [ref] for k, (ref, _) in refs.items()},
                "pins": {k: None if isinstance(pin, dict) else pin for k, (_, pin) in refs.items()}}

    # -- control calls (StoreCore) -----------------------------------------------

    @_ordered
    async def register_task(self, task: str, consumes: list[str], produces: list[str],
                            partition: str | None = None) -> None:
        self.core.register_task(task, consumes, produces, partition)

    @_ordered
    async def get_meta(self, task: str, columns: list[str], batch_size: int, kw: dict[str, Any],
                       locate: bool = False) -> dict[str, Any]:
        """The lease, with this actor's clock reading ``now`` (the handle times acks against the deadline). With
        ``locate``, also where its rows' columns lie (pinned, as :meth:`locate` answers) and the epoch they are
        current at: ``(shared-memory file, node, data.changes)``; a get on that node reads them if the file still
        holds that value (no value was replaced or freed since), else locates the rows again."""
        meta = await self.core.get_meta(task, columns, batch_size, **kw)
        out = {"meta": _meta_out(meta), "now": time.monotonic()}
        # (no await from the lease to here: the locations are those of the leased rows' values now)
        if locate and len(meta) and all(c in self.schema for c in columns) and self._epoch_file() is not None:
            out["located"] = self._locate(meta.row_ids, list(columns))
            out["epoch"] = (*self._epoch_at, self.data.changes)
        return out

    @_ordered
    async def ack(self, meta: dict[str, Any]) -> None:
        self.core.ack(_meta_in(meta))

    @_ordered
    async def release(self, meta: dict[str, Any]) -> None:
        self.core.release(_meta_in(meta))

    @_ordered
    async def renew(self, meta: dict[str, Any], lease_s: float | None) -> float | None:
        return self.core.renew(_meta_in(meta), lease_s)

    @_ordered
    async def declare_dead(self, consumer: str) -> int:
        return self.core.declare_dead(consumer)

    @_ordered
    async def end_stream(self, partition: str | None) -> None:
        self.core.end_stream(partition)

    @_ordered
    async def clear(self, partition: str | None) -> int:
        return self.core.clear(partition)

    @_ordered
    async def stats(self) -> dict[str, int]:
        self.core.check_open()
        out = self.core.controller.stats()
        out["bytes_stored"] = self.data.nbytes
        return out

    @_ordered
    async def close(self) -> None:
        self.core.close()
        self.data.clear()
        if self._epoch is not None:
            self._epoch.remove()

    # -- checkpoint ----------------------------------------------------------------

    @_ordered
    async def state_dict(self) -> dict[str, Any]:
        self.core.check_open()
        ctl = _without_unwritten_rows(self.core.controller.state_dict())
        live = ctl["row_ids"]
        located = {}
        for name in self.schema:  # taken at once: rows collected while the objects are read keep them pinned
            ids = live[self.data.where.has(live, name)]
            located[name] = (ids, *self.data.locate(ids, [name])) if ids.numel() else (ids, {}, {})
        pinned = self._pin_ranges(ref for _, _, refs in located.values() for ref, _ in refs.values())
        try:
            cols = await self._read_columns(located)
        finally:
            await self.unpin_ranges(pinned)
        return {"format": 1, "controller": ctl, "storage": {"format": 1, "columns": cols}}

    async def _read_columns(self, located: dict[str, Any]) -> dict[str, Any]:
        cols: dict[str, Any] = {}
        for name, (ids, loc, refs) in located.items():
            ragged, dtype, trailing = self.schema[name]
            if ids.numel():
                values = {k: await _fetch(ref, pin, self.units) for k, (ref, pin) in refs.items()}
                if any(not v for v in values.values()):
                    raise StoreError("an arena range was recycled while the checkpoint read it; take it again")
                data = _assemble(loc[name], {k: _column_from_wire(v[name]) for k, v in values.items()})
                # copies: a checkpoint must not pin the objects (nor share memory with the store)
                data = RaggedTensor(data.values.clone(), data.offsets.clone()) if isinstance(data, RaggedTensor) \
                    else data.clone()
            else:
                data = _empty_column(self.schema[name])
            cols[name] = {"ragged": ragged, "dtype": dtype, "trailing": tuple(trailing), "row_ids": ids, "data": data}
        return cols

    @_ordered
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.check_open()
        if not isinstance(state, dict) or state.get("format") != 1 or not {"controller", "storage"} <= set(state):
            raise InvalidRequestError("not a store state_dict; pass what state_dict() returned")
        storage = state["storage"]
        if not isinstance(storage, dict) or storage.get("format") != 1 or "columns" not in storage:
            raise InvalidRequestError("not a store state_dict (its storage part is malformed)")
        ctl = self.core.controller
        backup = ctl.state_dict()
        try:
            ctl.load_state_dict(state["controller"])
            schema = {name: (bool(c["ragged"]), str(c["dtype"]), tuple(c["trailing"]))
                      for name, c in storage["columns"].items()}
            for s in schema.values():
                _schema(s)  # a malformed dtype is rejected before anything is stored
        except Exception:
            ctl.load_state_dict(backup)  # a rejected load leaves the store as it was
            raise
        self.data.clear()
        self.schema = schema
        for name, c in storage["columns"].items():
            ids = torch.as_tensor(c["row_ids"], dtype=torch.int64).reshape(-1)
            if ids.numel() == 0:
                continue
            wire = {name: _column_to_wire(c["data"])}
            obj = self.data.add(self.data.new_id(), await asyncio.to_thread(ray.put, wire), _wire_nbytes(wire[name]))
            self.data.write(ids, torch.arange(ids.numel(), dtype=torch.int64), [name], obj)
        self.core.notify()


async def _fetch(ref: Any, pin: tuple[int, str] | None, units: list[Any]) -> dict[str, Any]:
    """An object's payload: mapped zero-copy from the object store, or, when its producer exited and took the
    object with it, from the storage unit that pins it (one copy). An arena range (a dict) is read by the unit on
    its node (one copy; ``{}`` when it was recycled meanwhile)."""
    if isinstance(ref, dict):
        return await units[ref["unit"]].read_range.remote(ref)
    try:
        return await ref
    except ray.exceptions.ObjectLostError:  # OwnerDiedError included
        if pin is None:
            raise
        return await units[pin[0]].read.remote(pin[1])


def _schema(s: tuple[bool, str, tuple[int, ...]]) -> ColumnSchema:
    """A wire schema (ragged, dtype name, trailing shape) as a :class:`ColumnSchema`."""
    dtype = getattr(torch, str(s[1]), None)
    if not isinstance(dtype, torch.dtype):
        raise ColumnTypeError(f"unknown column dtype {s[1]!r}")
    return ColumnSchema(bool(s[0]), dtype, tuple(int(x) for x in s[2]))


def _without_unwritten_rows(ctl: dict[str, Any]) -> dict[str, Any]:
    """Drop rows with no ready column: puts in flight (their data may not be stored yet) are not checkpointed."""
    keep = (ctl["ready"] != 0).any(dim=1) if ctl["ready"].numel() else torch.ones(ctl["row_ids"].numel(), dtype=torch.bool)
    if bool(keep.all()):
        return ctl
    k = ctl["row_ids"].numel()
    out = {key: (v[keep] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == k else v) for key, v in ctl.items()}
    out["task_state"] = {name: st[keep] for name, st in ctl["task_state"].items()}
    return out


_RemoteController = ray.remote(_ControllerActor)
_RemoteUnit = ray.remote(_StorageUnitActor)


# ====================================================================== the client


def _drop_located(located: dict[int, Any], key: int, unpins: Any, pins: list[tuple[str, int]]) -> None:
    """A meta whose locations no get read is gone: forget them and release their pins."""
    located.pop(key, None)
    unpins.extend(pins)


def _unwrap(exc: BaseException) -> BaseException:
    """The error an actor raised, as its own type (Ray wraps it in RayTaskError); a dead actor -> StoreClosedError."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException):
            return _unwrap(cause)
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
        return StoreClosedError(f"the store's actors are gone (closed, or their process died): {exc}")
    return exc


class RayStore(StreamStore):
    """A :class:`StreamStore` whose controller and storage units are Ray actors.

    ``RayStore(config)`` creates the actors (Ray must be initialised; see
    :func:`init_local_ray`). With ``config.name`` set and an actor of that name
    already running in ``config.namespace``, it joins that store instead (the
    config's controller options are then the creator's, not these).
    ``RayStore.join(name, namespace)`` only joins. A ``RayStore`` passed to a
    Ray task or actor arrives there as a joined handle.
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        from asyncflow_core.store.deployments.config import RayStoreConfig

        _require_ray()
        if config is None:
            config = RayStoreConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
        self.name: str | None = config.name
        self.namespace: str | None = config.namespace
        self._owned: list[Any] = []
        self._closed = False
        controller = self._lookup(config.name, config.namespace) if config.name else None
        if controller is None:
            self._create(config)  # returns at once: the actors boot while the caller goes on
        else:
            self._attach(controller, ray.get(controller.info.remote()))

    @classmethod
    def join(cls, name: str, namespace: str | None = None) -> RayStore:
        """A handle on the running store whose controller actor is ``name`` (``ConfigError`` if there is none)."""
        _require_ray()
        controller = cls._lookup(name, namespace)
        if controller is None:
            raise ConfigError(f"no ray store named {name!r} in namespace {namespace!r}; create it first (name=...)")
        return cls._from_handle(controller, name, namespace)

    @classmethod
    def _from_handle(cls, controller: Any, name: str | None, namespace: str | None) -> RayStore:
        self = cls.__new__(cls)
        self.name, self.namespace, self._owned, self._closed = name, namespace, [], False
        self._attach(controller, ray.get(controller.info.remote()))
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (RayStore._from_handle, (self._controller, self.name, self.namespace))

    @staticmethod
    def _lookup(name: str, namespace: str | None) -> Any:
        """The live controller actor named ``name``, or None (a killed one can stay listed for a moment)."""
        try:
            controller = ray.get_actor(name, namespace=namespace)
            ray.get(controller.info.remote())
        except (ValueError, ray.exceptions.RayActorError):
            return None
        return controller

    def _create(self, config: Any) -> None:
        from asyncflow_core.store.options import StoreOptions

        options = config.model_dump(include=set(StoreOptions.model_fields))
        units = [_RemoteUnit.options(num_cpus=0).remote() for _ in range(config.num_storage_units)]
        opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": MAX_CONCURRENCY}
        if config.name:
            opts.update(name=config.name, namespace=config.namespace, get_if_exists=True)
        controller = _RemoteController.options(**opts).remote(options, units, tuple(config.token_columns))
        if config.name:
            info = ray.get(controller.info.remote())
            if [u._actor_id for u in info["units"]] != [u._actor_id for u in units]:  # noqa: SLF001
                for u in units:  # another driver created the store first: join it
                    ray.kill(u)
                self._attach(controller, info)
                return
        self._owned = [controller, *units]
        self._attach(controller, {"units": units, "token_columns": config.token_columns})

    def _attach(self, controller: Any, info: dict[str, Any]) -> None:
        self._controller = controller
        self._store_key: str = controller._actor_id.hex()  # noqa: SLF001  (names the store's arena directory)
        self._node: str = ray.get_runtime_context().get_node_id()
        self._arena: ProducerArena | None = None  # made at the first put through it (see _producer_arena)
        self._arena_checked = False
        self._reader = ArenaReader()
        #: arena ranges this handle's readers are done with, sent with its next call (a deque: a batch's last
        #: reference, and so the append, can go away on any thread)
        self._unpins: collections.deque[tuple[str, int]] = collections.deque()
        self._units: list[Any] = list(info["units"])
        self._turn = 0  # the storage unit that pins this handle's next put
        #: acks this handle sends without waiting (see :meth:`ack`): its name at the controller, how many it sent,
        #: and the leases it got and has not ended, each with a time (this process's monotonic clock) before which
        #: the lease is surely live
        self._caller = uuid.uuid4().hex
        self._acks_sent = 0
        self._held: dict[int, float] = {}
        #: where a lease's rows lay when get_meta answered (see :meth:`get`): id(meta) -> (weak reference to the
        #: meta, the locate answer, the epoch it is current at, the finalizer that unpins it if no get reads it)
        self._located: dict[int, tuple[Any, dict[str, Any], int, Any]] = {}
        self._epoch: ray_arena.Epoch | None = None  # the controller's epoch file, when it is on this node
        self._prelocate = True  # ask get_meta for the locations (off once the controller is found elsewhere)
        self.token_columns: tuple[str, ...] = tuple(info["token_columns"])

    @property
    def features(self) -> StoreFeatures:
        return RAY_FEATURES

    @property
    def owner(self) -> bool:
        """True for the handle that created the actors (its ``close`` closes the store for everyone)."""
        return bool(self._owned)

    # -- plumbing --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this ray store handle was closed; create or join a new one")

    async def _await(self, ref: Any) -> Any:
        try:
            return await ref
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            raise _unwrap(exc) from None

    def _after(self) -> dict[str, Any]:
        """The keyword that orders a controller call after this handle's acks sent without waiting."""
        return {"_after": (self._caller, self._acks_sent)} if self._acks_sent else {}

    async def _ctl(self, method: str, *args: Any) -> Any:
        self._check_open()
        if method in ("put", "locate"):  # they carry this handle's unpins (no call of their own)
            return await self._await(getattr(self._controller, method).remote(*args, self._take_unpins(),
                                                                              **self._after()))
        kw = self._after()
        if self._unpins:  # carried by the call (no call of their own)
            kw["_unpins"] = self._take_unpins()
        return await self._await(getattr(self._controller, method).remote(*args, **kw))

    def _take_unpins(self) -> list[tuple[str, int]]:
        keys = []
        while self._unpins:
            keys.append(self._unpins.popleft())
        return keys

    def _send_unpins(self) -> None:
        if self._unpins:  # fire and forget: nothing waits for a range's recycling
            self._controller.unpin_ranges.remote(self._take_unpins())

    # -- put / get ---------------------------------------------------------------------

    async def put(
        self,
        columns: Mapping[str, Column],
        *,
        rows: BatchMeta | None = None,
        partition: str = "default",
        group_ids: torch.Tensor | Sequence[int] | None = None,
        versions: torch.Tensor | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> BatchMeta:
        self._check_open()
        cols = dict(columns)
        n = rows_of(cols)
        schema: dict[str, tuple[bool, str, tuple[int, ...]]] = {}
        for name, col in cols.items():
            if not isinstance(name, str) or not name:
                raise ColumnTypeError(f"column names must be non-empty strings, got {name!r}")
            if isinstance(col, RaggedTensor):
                values, got = col.values, len(col)
            elif isinstance(col, torch.Tensor):
                if col.dim() == 0:
                    raise ColumnTypeError(f"dense column {name!r} needs a leading row dimension; got a 0-d tensor")
                values, got = col, int(col.shape[0])
            else:
                raise ColumnTypeError(
                    f"column {name!r} must be a torch.Tensor (dense) or a RaggedTensor, got {type(col).__name__}"
                )
            if got != n:
                raise ColumnTypeError(
                    f"column {name!r} holds {got} rows but {n} rows are being written; "
                    "give every column one value (or sequence) per row"
                )
            schema[name] = (isinstance(col, RaggedTensor), str(values.dtype).removeprefix("torch."),
                            tuple(values.shape[1:]))
        v = check_versions(versions, n)
        if timeout is not None and timeout < 0:
            raise InvalidRequestError(f"timeout must be >= 0 or None, got {timeout}")
        ids_in = None
        if rows is not None:
            if group_ids is not None:
                raise InvalidRequestError("group_ids apply to new rows only; put(rows=...) writes existing rows")
            ids_in = torch.as_tensor(rows.row_ids, dtype=torch.int64).reshape(-1)
            if ids_in.numel() != n:
                raise ColumnTypeError(f"columns hold {n} rows but rows names {ids_in.numel()}; give one value per row")
        gids = None
        if group_ids is not None:
            gids = torch.as_tensor(group_ids, dtype=torch.int64).reshape(-1)
            if gids.numel() != n:
                raise InvalidRequestError(f"group_ids has {gids.numel()} entries for {n} rows; give one per row")
        tokens = num_tokens_of(cols, self.token_columns)

        wire = {k: _column_to_wire(c) for k, c in cols.items()}
        nbytes = sum(_wire_nbytes(w) for w in wire.values())
        args = (schema, n, _np(ids_in), partition, _np(gids), block, timeout)
        if nbytes <= INLINE_BYTES:
            ids = await self._ctl("put", *args, ("inline", wire), nbytes, _np(v), _np(tokens))
            return BatchMeta(row_ids=_pt(ids), columns=tuple(cols), group_ids=gids, extra={"partition": partition})
        arena = await self._producer_arena()
        desc = arena.place(wire) if arena is not None else None
        if desc is not None:  # one warm copy into this producer's shared-memory arena, then one controller call
            if nbytes > _THREAD_PUT_BYTES:
                await asyncio.to_thread(arena.fill, desc, wire)
            else:
                arena.fill(desc, wire)
            try:
                ids, freed = await self._ctl("put", *args, ("arena", desc), nbytes, _np(v), _np(tokens))
            except Exception:  # (not a cancellation: the controller call may still complete then)
                arena.release(desc)  # not indexed: the range is this producer's again
                raise
            arena.free(freed)
            return BatchMeta(row_ids=_pt(ids), columns=tuple(cols), group_ids=gids, extra={"partition": partition})
        # one copy into the object store; then, at once, the controller call (rows, index, ready bits) and a storage
        # unit's pin (it maps the object so the rows outlive this process); the put returns when both are done
        ref = await asyncio.to_thread(ray.put, wire) if nbytes > _THREAD_PUT_BYTES else ray.put(wire)
        unit = self._turn % len(self._units)
        self._turn += 1
        self._check_open()
        pinned = self._units[unit].pin.remote(ref.hex(), ref)
        put = self._controller.put.remote(*args, ("ref", [ref], unit), nbytes, _np(v), _np(tokens), **self._after())
        try:
            ids = await self._await(put)
        except Exception:  # (not a cancellation: the controller call may still complete then)
            self._units[unit].unpin.remote([ref.hex()])  # the rows were not stored: nothing to keep
            raise
        await self._await(pinned)
        return BatchMeta(row_ids=_pt(ids), columns=tuple(cols), group_ids=gids, extra={"partition": partition})

    async def get(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> Batch:
        """The rows' columns: read-only views of Ray objects, or own copies of arena ranges (module docstring)."""
        self._check_open()
        names = list(meta.columns if columns is None else columns)
        ids = torch.as_tensor(meta.row_ids, dtype=torch.int64).reshape(-1)
        located = self._take_located(meta, names)  # where get_meta found the rows, when still current
        for _ in range(_READ_TRIES):
            reply = located if located is not None else await self._ctl("locate", _np(ids), names)
            located = None
            keys = list(reply["objects"])
            try:
                values = await asyncio.gather(*(self._read(reply["objects"][k], reply["pins"][k], names)
                                                for k in keys))
            except RangeRecycledError:  # a column was rewritten (its range recycled) while read: locate again
                continue
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError,
                    ray.exceptions.ObjectLostError) as exc:
                raise _unwrap(exc) from None
            objects = dict(zip(keys, values, strict=True))
            cols: dict[str, Column] = {}
            for k in names:
                if ids.numel() == 0:
                    cols[k] = _empty_column(reply["schema"][k])
                    continue
                loc = _pt(reply["loc"][k])
                cols[k] = _assemble(loc, {o: objects[o][k] for o in torch.unique(loc[:, 0]).tolist()})
            return Batch(cols, row_ids=meta.row_ids, num_rows=len(meta))
        raise StoreError(f"the rows' columns were rewritten during each of {_READ_TRIES} reads; read them again")

    async def _read(self, obj: Any, pin: Any, names: list[str]) -> dict[str, Column]:
        """One object's (or arena range's) columns ``names``."""
        if not isinstance(obj, dict):
            wire = await _fetch(obj[0], pin, self._units)
            return {k: _column_from_wire(wire[k]) for k in names if k in wire}
        key = (obj["arena"], obj["seq"])  # pinned by the locate that named it
        if obj["node"] == self._node:  # same node: views of the mapped file, unpinned once no view is left
            try:
                parts = self._reader.read(obj, names, on_release=lambda: self._unpins.append(key))
            except RangeRecycledError:
                self._unpins.append(key)
                raise
            return {k: RaggedTensor(p["v"], p["o"]) if "o" in p else p["v"] for k, p in parts.items()}
        try:  # another node: the unit on the range's node copies it into its reply
            wire = await self._units[obj["unit"]].read_range.remote(obj, names)
        finally:
            self._unpins.append(key)
        if not wire:
            raise RangeRecycledError(obj["path"])
        return {k: _column_from_wire(w) for k, w in wire.items()}

    async def _producer_arena(self) -> ProducerArena | None:
        """This handle's arena, made at its first large put when a storage unit runs on this node (else None:
        puts go through Ray's object store, which moves objects between nodes)."""
        if self._arena is None and not self._arena_checked:
            self._arena_checked = True
            if ray_arena.ARENA_MAX_BYTES > 0 and os.path.isdir(ray_arena.SHM_ROOT):
                nodes = await asyncio.gather(*(self._await(u.node.remote()) for u in self._units))
                here = [i for i, (node, _) in enumerate(nodes) if node == self._node]
                if here:
                    self._arena = ProducerArena(self._store_key, self._node, here[0], nodes[here[0]][1])
        return self._arena

    # -- control calls -------------------------------------------------------------------

    async def register_task(self, task: str, *, consumes: Sequence[str] = (), produces: Sequence[str] = (),
                            partition: str | None = None) -> None:
        await self._ctl("register_task", task, list(consumes), list(produces), partition)

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
        if isinstance(columns, str):
            raise InvalidRequestError(f"columns must be a sequence of names, got the string {columns!r}")
        kw = dict(sampler=sampler, min_version=min_version, partition=partition, partial=partial, timeout=timeout,
                  lease_s=lease_s, consumer=consumer, dp_rank=dp_rank, dp_size=dp_size)
        sent = time.monotonic()
        reply = await self._ctl("get_meta", task, list(columns), batch_size, kw, self._prelocate)
        meta = _meta_in(reply["meta"])
        if meta.lease_id is not None and meta.deadline is not None:
            # the actor granted it after ``sent``: live at least until sent + what was left of it then
            self._hold(int(meta.lease_id), sent + (meta.deadline - reply["now"]))
        if "located" in reply:
            self._keep_located(meta, reply["located"], *reply["epoch"])
        return meta

    def _keep_located(self, meta: BatchMeta, located: dict[str, Any], path: str, node: str, epoch: int) -> None:
        pins = [(o["arena"], o["seq"]) for o in located["objects"].values() if isinstance(o, dict)]
        if self._epoch is None and node == self._node:
            try:
                self._epoch = ray_arena.Epoch(path)
            except OSError:
                pass
        if self._epoch is None or self._epoch.path != path:  # the controller is elsewhere: ask it at each get
            self._prelocate = False
            self._unpins.extend(pins)
            return
        key = id(meta)
        done = weakref.finalize(meta, _drop_located, self._located, key, self._unpins, pins)
        self._located[key] = (weakref.ref(meta), located, epoch, done)

    def _take_located(self, meta: BatchMeta, names: list[str]) -> dict[str, Any] | None:
        """What get_meta answered for ``meta``, if nothing was replaced or freed since (the epoch says) and it
        covers ``names``; else None, its pins released. Taken once: a second get of the meta locates again."""
        entry = self._located.pop(id(meta), None)
        if entry is None or entry[0]() is not meta:
            return None
        ref, located, epoch, done = entry
        done.detach()
        if self._epoch is not None and self._epoch.value == epoch and all(k in located["loc"] for k in names):
            return located
        self._unpins.extend((o["arena"], o["seq"]) for o in located["objects"].values() if isinstance(o, dict))
        return None

    def _hold(self, lease_id: int, live_until: float) -> None:
        held = self._held
        if len(held) >= _LEASES_REMEMBERED:  # leases never ended here: forget the expired, then the oldest
            now = time.monotonic()
            for lid in [lid for lid, until in held.items() if until <= now]:
                del held[lid]
            while len(held) >= _LEASES_REMEMBERED:
                del held[next(iter(held))]
        held[lease_id] = live_until

    async def ack(self, meta: BatchMeta) -> None:
        """Acknowledge a lease. One this handle got from ``get_meta``, has not ended, and holds for at least
        :data:`_ACK_MARGIN_S` more is acknowledged **without waiting** for the controller's reply: the controller
        applies it before any later call of this handle (its acks in order), and if it fails after all (another
        handle declared the consumer dead or cleared the rows meanwhile, or it arrived after the deadline), this
        handle's next call to the controller raises its error instead of doing anything (``close`` raises it after
        closing; a get that reads where get_meta found the rows makes no call). Any
        other ack (a second one, someone else's lease, one about to expire) waits and raises at once."""
        lid = meta.lease_id if isinstance(meta, BatchMeta) else None
        live_until = self._held.pop(lid, None) if isinstance(lid, int) else None
        if live_until is None or time.monotonic() >= live_until - _ACK_MARGIN_S:
            await self._ctl("ack", _meta_out(meta))
            return
        self._check_open()
        self._acks_sent += 1  # (ack_after orders itself after this handle's earlier acks)
        self._controller.ack_after.remote(_meta_out(meta), self._caller, self._acks_sent, self._take_unpins())

    async def release(self, meta: BatchMeta) -> None:
        self._forget(meta)
        await self._ctl("release", _meta_out(meta))

    async def renew(self, meta: BatchMeta, *, lease_s: float | None = None) -> float | None:
        deadline = await self._ctl("renew", _meta_out(meta), lease_s)
        if deadline is None:
            self._forget(meta)  # (a renewed lease keeps its earlier, shorter, surely-live time)
        return deadline

    def _forget(self, meta: BatchMeta) -> None:
        if isinstance(meta, BatchMeta) and isinstance(meta.lease_id, int):
            self._held.pop(meta.lease_id, None)

    async def declare_dead(self, consumer: str) -> int:
        self._held.clear()  # (which leases were the consumer's is the controller's to know)
        return await self._ctl("declare_dead", consumer)

    async def end_stream(self, partition: str | None = None) -> None:
        await self._ctl("end_stream", partition)

    async def clear(self, partition: str | None = None) -> int:
        self._held.clear()
        return await self._ctl("clear", partition)

    async def state_dict(self) -> dict[str, Any]:
        return await self._ctl("state_dict")

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self._held.clear()
        await self._ctl("load_state_dict", state)

    async def stats(self) -> dict[str, int]:
        return await self._ctl("stats")

    async def close(self) -> None:
        """Creating handle: close the store (waiters get ``StoreClosedError``) and kill its actors. Joined: detach."""
        if self._closed:
            return
        failed: BaseException | None = None
        if self._acks_sent:  # this handle's acks not awaited are applied (and their errors raised) before it closes
            try:
                await self._ctl("settle", self._caller)
            except StoreClosedError:
                pass
            except StoreError as exc:
                failed = exc
        self._closed = True
        self._held.clear()
        self._located.clear()
        owned, self._owned = self._owned, []
        if self._arena is not None:
            self._arena.close()
        self._reader.close()
        try:
            self._send_unpins()
        except Exception:  # noqa: BLE001  (the store may be gone already; pins die with it)
            pass
        if owned:
            try:
                await self._await(self._controller.close.remote())
            except StoreError:
                pass
            try:  # every node with a unit: the only nodes whose producers used arenas
                await asyncio.gather(*(self._await(u.remove_arenas.remote(self._store_key)) for u in self._units))
            except StoreError:
                pass
            for actor in owned:
                ray.kill(actor, no_restart=True)
        if failed is not None:
            raise failed


__all__ = ["RayStore", "init_local_ray", "ray_listening_addresses"]
