"""The ray deployment: the controller and the storage units are Ray actors; clients anywhere in the cluster.

Actors:

- **controller**: an *async* actor serving a :class:`StoreCore` (the same
  control core the multiprocess server runs). A blocking ``get_meta`` or a
  ``put`` waiting for capacity awaits the core's asyncio notification inside
  the actor (``max_concurrency`` sized for many waiters); nothing polls. Lease
  deadlines are on the controller actor's monotonic clock.
- **storage units** (``num_storage_units``): plain (one call at a time) actors
  each holding a :class:`~asyncflow_core.store.storage.StorageUnit`. Rows are
  spread by row id in stripes of :data:`STRIPE_ROWS` (``unit = row_id //
  STRIPE_ROWS % num_units``), so the rows of one put land in few pieces.

Data path. Column values travel as numpy arrays (torch tensors viewed, no
copy), which Ray serialises out of band straight into its shared-memory object
store, never through pickle:

- put: the client validates cheaply (types, row counts, versions), asks the
  controller for row ids (``begin_put``: schema check, capacity wait), sends
  each unit its rows (payloads above :data:`INLINE_BYTES` are ``ray.put`` once
  and passed by reference; **one copy** into the object store), the unit reads
  them zero-copy from the object store and writes them into its buffers
  (**one copy**); only then does the controller set the ready bits
  (``commit_put``). Data is always stored before a row can be leased.
- get: the client asks each unit holding rows of the meta for them; a unit
  gathers (**one copy**) and replies through the object store (**one copy**);
  the client wraps the reply zero-copy and, with several units, reassembles
  the rows in meta order (one more copy).

The controller frees a row's data (fire-and-forget calls to the units) when
the row is collected after its last ack, or cleared.

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
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.store.deployments.core import StoreCore, check_versions, num_tokens_of, rows_of
from asyncflow_core.store.deployments.features import RAY_FEATURES
from asyncflow_core.store.errors import (
    ColumnTypeError,
    InvalidRequestError,
    StoreClosedError,
    StoreError,
)
from asyncflow_core.store.storage import ColumnSchema, check_column_schema
from asyncflow_core.types import Batch, Column, RaggedTensor

try:
    import ray
except ImportError as _exc:  # pragma: no cover - exercised only without ray
    raise ImportError("the ray store deployment needs Ray: pip install 'asyncflow[ray]'") from _exc

STRIPE_ROWS = 64  #: consecutive row ids kept in one storage unit
INLINE_BYTES = 100 << 10  #: payloads above this are ray.put once and passed by reference
MAX_CONCURRENCY = 10_000  #: concurrent calls (mostly blocked waiters) the controller actor serves
_THREAD_PUT_BYTES = 8 << 20  #: larger ray.put copies run off the event loop thread

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
    arr, dtype, shape = w
    with warnings.catch_warnings():  # a reply read from the object store is a read-only buffer of our own
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr) if arr.size else torch.from_numpy(np.array(arr))
    if not arr.flags.writeable and arr.nbytes < INLINE_BYTES:
        t = t.clone()  # small replies arrive inline (immutable bytes): own them
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


def unit_of(row_ids: torch.Tensor, num_units: int) -> torch.Tensor:
    """Index of the storage unit holding each row."""
    return torch.div(row_ids, STRIPE_ROWS, rounding_mode="floor") % num_units


def _select(col: Column, idx: torch.Tensor) -> Column:
    """Rows ``idx`` (increasing) of a column: a view when they are one contiguous run."""
    if idx.numel() and int(idx[-1]) - int(idx[0]) + 1 == idx.numel():
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        return col[lo:hi]
    return col.select(idx) if isinstance(col, RaggedTensor) else col[idx]


# ====================================================================== the actors


class _StorageUnitActor:
    """One storage unit: a :class:`StorageUnit` behind a one-call-at-a-time actor (calls run in order)."""

    def __init__(self) -> None:
        from asyncflow_core.store.storage import StorageUnit

        self.unit = StorageUnit("cpu")

    def write(self, row_ids: torch.Tensor, columns: dict[str, dict[str, Any]]) -> None:
        self.unit.write(row_ids, {k: _column_from_wire(w) for k, w in columns.items()})

    def read(self, row_ids: torch.Tensor, names: list[str]) -> dict[str, dict[str, Any]]:
        batch = self.unit.read(row_ids, names)
        return {k: _column_to_wire(batch[k]) for k in names}

    def free(self, row_ids: torch.Tensor) -> None:
        self.unit.free(row_ids)

    def nbytes(self) -> int:
        return self.unit.nbytes

    def state_dict(self) -> dict[str, Any]:
        return self.unit.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.unit.load_state_dict(state)


class _ControllerActor:
    """An async actor serving a :class:`StoreCore`; also keeps column schemas and orchestrates the units."""

    def __init__(self, options: dict[str, Any], units: list[Any], token_columns: tuple[str, ...]) -> None:
        from asyncflow_core.store.options import StoreOptions

        self.core = StoreCore(StoreOptions(**options).controller(), on_drop=self._free_data)
        self.units = units
        self.token_columns = tuple(token_columns)
        self.schema: dict[str, tuple[bool, str, tuple[int, ...]]] = {}  # name -> (ragged, dtype, trailing)
        self._frozen = 0  # > 0 while a checkpoint reads the units: frees wait
        self._queued_frees: list[torch.Tensor] = []

    async def info(self) -> dict[str, Any]:
        return {"units": self.units, "token_columns": self.token_columns}

    # -- data bookkeeping --------------------------------------------------------

    def _free_data(self, row_ids: torch.Tensor) -> None:
        if self._frozen:
            self._queued_frees.append(row_ids)
            return
        where = unit_of(row_ids, len(self.units))
        for u, unit in enumerate(self.units):
            ids = row_ids[where == u]
            if ids.numel():
                unit.free.remote(ids)

    def _live(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Bool per id: is it a live row? (the controller's own lookup)"""
        return self.core.controller.live_mask(row_ids)

    def _drop_rows(self, row_ids: torch.Tensor) -> None:
        """Drop rows a put allocated but did not complete (they have no ready bit, so nobody leased them)."""
        if self.core.controller.drop_rows(row_ids).numel():
            self.core.notify()

    def _check_schema(self, schema: dict[str, tuple[bool, str, tuple[int, ...]]]) -> None:
        for name, got in schema.items():
            want = self.schema.get(name)
            if want is not None:
                check_column_schema(name, _schema(want), _schema(got))

    # -- put ---------------------------------------------------------------------

    async def begin_put(
        self, schema: dict[str, Any], n: int, row_ids: torch.Tensor | None, partition: str, group_ids: Any,
        block: bool, timeout: float | None,
    ) -> torch.Tensor:
        """Schema check, then new row ids (waiting for capacity) or a check that ``row_ids`` are live."""
        self.core.check_open()
        self._check_schema(schema)
        if row_ids is None:
            ids = await self.core.add_rows(n, partition, group_ids, block, timeout)
            try:
                self._check_schema(schema)  # another put may have fixed a schema while this one waited
            except BaseException:
                self._drop_rows(ids)
                raise
        else:
            self.core.controller.check_rows(row_ids)
            ids = row_ids
        for name, s in schema.items():
            self.schema.setdefault(name, tuple(s))
        return ids

    async def commit_put(self, row_ids: torch.Tensor, columns: list[str], versions: Any, num_tokens: Any) -> None:
        """Set the ready bits once the units hold the data; rows cleared meanwhile only get their data freed."""
        live = self._live(row_ids)
        if not bool(live.all()):
            self._free_data(row_ids[~live])
            row_ids = row_ids[live]
            versions = None if versions is None else versions[live]
            num_tokens = None if num_tokens is None else num_tokens[live]
        if row_ids.numel():
            self.core.mark_ready(row_ids, columns, versions, num_tokens)

    async def abort_put(self, row_ids: torch.Tensor, new: bool, writes: list[Any]) -> None:
        """A put failed or was cancelled after ``begin_put``: drop its new rows, free whatever data landed."""
        if new:
            self._drop_rows(row_ids)
        if writes:
            await asyncio.gather(*writes, return_exceptions=True)  # frees must follow the writes
        if new:
            self._free_data(row_ids)

    # -- control calls (StoreCore) -----------------------------------------------

    async def register_task(self, task: str, consumes: list[str], produces: list[str],
                            partition: str | None = None) -> None:
        self.core.register_task(task, consumes, produces, partition)

    async def get_meta(self, task: str, columns: list[str], batch_size: int, kw: dict[str, Any]) -> BatchMeta:
        return await self.core.get_meta(task, columns, batch_size, **kw)

    async def ack(self, meta: BatchMeta) -> None:
        self.core.ack(meta)

    async def release(self, meta: BatchMeta) -> None:
        self.core.release(meta)

    async def renew(self, meta: BatchMeta, lease_s: float | None) -> float | None:
        return self.core.renew(meta, lease_s)

    async def declare_dead(self, consumer: str) -> int:
        return self.core.declare_dead(consumer)

    async def end_stream(self, partition: str | None) -> None:
        self.core.end_stream(partition)

    async def clear(self, partition: str | None) -> int:
        return self.core.clear(partition)

    async def stats(self) -> dict[str, int]:
        self.core.check_open()
        out = self.core.controller.stats()
        sizes = await asyncio.gather(*(u.nbytes.remote() for u in self.units))  # after every free sent before
        out["bytes_stored"] = int(sum(sizes))
        return out

    async def close(self) -> None:
        self.core.close()

    # -- checkpoint ----------------------------------------------------------------

    async def state_dict(self) -> dict[str, Any]:
        self.core.check_open()
        ctl = _without_unwritten_rows(self.core.controller.state_dict())
        self._frozen += 1  # rows collected while the units are read keep their data until the read is done
        try:
            states = await asyncio.gather(*(u.state_dict.remote() for u in self.units))
        finally:
            self._frozen -= 1
            if not self._frozen and self._queued_frees:
                queued, self._queued_frees = self._queued_frees, []
                self._free_data(torch.cat(queued))
        return {"format": 1, "controller": ctl, "storage": _merge_units(states, ctl["row_ids"], self.schema)}

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
            parts = _split_units(storage, len(self.units))
        except Exception:
            ctl.load_state_dict(backup)  # a rejected load leaves the store as it was
            raise
        await asyncio.gather(*(u.load_state_dict.remote(p) for u, p in zip(self.units, parts, strict=True)))
        self.schema = {name: (bool(c["ragged"]), str(c["dtype"]), tuple(c["trailing"]))
                       for name, c in storage["columns"].items()}
        self.core.notify()


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


def _merge_units(states: list[dict[str, Any]], live: torch.Tensor, schema: dict[str, Any]) -> dict[str, Any]:
    """One StorageUnit-format state of every unit's rows that the controller state keeps (the in-process format)."""
    cols: dict[str, Any] = {}
    for name, (ragged, dtype, trailing) in schema.items():
        parts = [s["columns"][name] for s in states if name in s["columns"]]
        ids = torch.cat([p["row_ids"] for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
        if ragged:
            data: Column = RaggedTensor.cat([p["data"] for p in parts]) if parts else RaggedTensor.empty(
                getattr(torch, dtype), tuple(trailing))
        else:
            data = torch.cat([p["data"] for p in parts]) if parts else torch.empty((0, *trailing),
                                                                                  dtype=getattr(torch, dtype))
        keep = torch.isin(ids, live)
        order = torch.argsort(ids[keep])
        idx = keep.nonzero().squeeze(1)[order]
        data = data.select(idx) if isinstance(data, RaggedTensor) else data[idx]
        cols[name] = {"ragged": ragged, "dtype": dtype, "trailing": tuple(trailing), "row_ids": ids[idx], "data": data}
    return {"format": 1, "columns": cols}


def _split_units(storage: dict[str, Any], num_units: int) -> list[dict[str, Any]]:
    """Per-unit StorageUnit states of a merged one (every unit keeps every column's schema)."""
    out = [{"format": 1, "columns": {}} for _ in range(num_units)]
    for name, c in storage["columns"].items():
        ids = torch.as_tensor(c["row_ids"], dtype=torch.int64).reshape(-1)
        where = unit_of(ids, num_units)
        for u in range(num_units):
            idx = (where == u).nonzero().squeeze(1)
            data = c["data"].select(idx) if isinstance(c["data"], RaggedTensor) else c["data"][idx]
            out[u]["columns"][name] = {**c, "row_ids": ids[idx], "data": data}
    return out


_RemoteController = ray.remote(_ControllerActor)
_RemoteUnit = ray.remote(_StorageUnitActor)


# ====================================================================== the client


def _unwrap(exc: BaseException) -> BaseException:
    """The error an actor raised, as its own type (Ray wraps it in RayTaskError); a dead actor -> StoreClosedError."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException):
            return _unwrap(cause)
    if isinstance(exc, ray.exceptions.RayActorError):
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
        self._units: list[Any] = list(info["units"])
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

    async def _ctl(self, method: str, *args: Any) -> Any:
        self._check_open()
        return await self._await(getattr(self._controller, method).remote(*args))

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

        ids = await self._ctl("begin_put", schema, n, ids_in, partition, gids, block, timeout)
        writes: list[Any] = []
        try:
            where = unit_of(ids, len(self._units))
            for u, unit in enumerate(self._units):
                idx = (where == u).nonzero().squeeze(1) if len(self._units) > 1 else None
                if idx is not None and idx.numel() == 0:
                    continue
                part_ids = ids if idx is None else ids[idx]
                wire = {k: _column_to_wire(c if idx is None else _select(c, idx)) for k, c in cols.items()}
                size = sum(_wire_nbytes(w) for w in wire.values())
                if size > _THREAD_PUT_BYTES:
                    payload = await asyncio.to_thread(ray.put, wire)  # one copy into the object store
                elif size > INLINE_BYTES:
                    payload = ray.put(wire)
                else:
                    payload = wire
                writes.append(unit.write.remote(part_ids, payload))
            for ref in writes:
                await self._await(ref)
            await self._ctl("commit_put", ids, list(cols), v, tokens)
        except BaseException:
            if not self._closed:
                try:  # the controller waits for the writes, then drops the rows and frees their data
                    self._controller.abort_put.remote(ids, rows is None, writes)
                except Exception:  # noqa: BLE001 - the store is gone; nothing to undo
                    pass
            raise
        return BatchMeta(row_ids=ids, columns=tuple(cols), group_ids=gids, extra={"partition": partition})

    async def get(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> Batch:
        self._check_open()
        names = list(meta.columns if columns is None else columns)
        ids = torch.as_tensor(meta.row_ids, dtype=torch.int64).reshape(-1)
        if len(self._units) == 1 or ids.numel() == 0:
            reply = await self._await(self._units[0].read.remote(ids, names))
            cols = {k: _column_from_wire(reply[k]) for k in names}
            return Batch(cols, row_ids=meta.row_ids, num_rows=len(meta))
        where = unit_of(ids, len(self._units))
        picks, refs = [], []
        for u, unit in enumerate(self._units):
            idx = (where == u).nonzero().squeeze(1)
            if idx.numel():
                picks.append(idx)
                refs.append(unit.read.remote(ids[idx], names))
        replies = [await self._await(r) for r in refs]
        order = torch.argsort(torch.cat(picks))  # meta position -> position in the concatenated parts
        cols = {}
        for k in names:
            parts = [_column_from_wire(r[k]) for r in replies]
            if isinstance(parts[0], RaggedTensor):
                cols[k] = RaggedTensor.cat(parts).select(order)
            else:
                cols[k] = torch.cat(parts)[order]
        return Batch(cols, row_ids=meta.row_ids, num_rows=len(meta))

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
        return await self._ctl("get_meta", task, list(columns), batch_size, kw)

    async def ack(self, meta: BatchMeta) -> None:
        await self._ctl("ack", meta)

    async def release(self, meta: BatchMeta) -> None:
        await self._ctl("release", meta)

    async def renew(self, meta: BatchMeta, *, lease_s: float | None = None) -> float | None:
        return await self._ctl("renew", meta, lease_s)

    async def declare_dead(self, consumer: str) -> int:
        return await self._ctl("declare_dead", consumer)

    async def end_stream(self, partition: str | None = None) -> None:
        await self._ctl("end_stream", partition)

    async def clear(self, partition: str | None = None) -> int:
        return await self._ctl("clear", partition)

    async def state_dict(self) -> dict[str, Any]:
        return await self._ctl("state_dict")

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._ctl("load_state_dict", state)

    async def stats(self) -> dict[str, int]:
        return await self._ctl("stats")

    async def close(self) -> None:
        """Creating handle: close the store (waiters get ``StoreClosedError``) and kill its actors. Joined: detach."""
        if self._closed:
            return
        self._closed = True
        owned, self._owned = self._owned, []
        if owned:
            try:
                await self._await(self._controller.close.remote())
            except StoreError:
                pass
            for actor in owned:
                ray.kill(actor, no_restart=True)


__all__ = ["RayStore", "init_local_ray", "ray_listening_addresses", "unit_of"]
