"""``dist`` weight transport: torch.distributed broadcast from a source rank, announced before it is received.

Process model. Every rank of the transport's group (the trainer's exporting
rank as ``source_rank`` and one rank per rollout engine) builds the
transport with the same ``world_size`` and ``port``. The transport makes its
*own* group — a ``TCPStore`` whose rank-0 listener is bound to 127.0.0.1 by
this module (the technique of
:func:`asyncflow_core.store.deployments.distributed.init_loopback_process_group`)
and a gloo (CPU) or NCCL (CUDA) process group on it — so weight broadcasts
never interleave with other traffic on the default group. Joining happens on
a background thread: the constructor returns at once, and ``send`` /
``receive`` wait for the join within their deadlines.

Announce before receive. A gloo receive that times out poisons its
connection, so no rank posts a broadcast for a transfer the others have not
committed to. The rendezvous key-value store carries the control messages
(a wait on it can time out harmlessly):

1. the source writes ``ann/<seq>``: a JSON manifest of the version (names,
   dtypes, shapes, offsets, checksums), the chunk size and the time left;
2. each receiver rank's listener thread sees it, takes the payload's buffer
   (over gloo, with ``keep_buffers``, a buffer of an :class:`ExportArena`
   kept across versions: a free one is reused, so its pages are not faulted
   in again by the receive) and writes ``ready/<seq>/<rank>``;
3. the source, once every receiver is ready, sets ``state/<seq>`` to ``go``
   with a compare-and-set; a side whose deadline passes first sets it to
   ``abort`` instead. Whoever wins decides for everyone, so a broadcast is
   posted either by all ranks or by none;
4. the payload (the bucket buffers laid end to end) moves in broadcasts of
   at most ``chunk_mb``, each inside one bucket (:func:`message_ranges`:
   every bucket cut in ``chunk_mb`` pieces, the last one shorter), so the
   source sends views of its bucket buffers, no packed copy; they are
   received in place into the receiver's buffer;
5. each receiver verifies every bucket's checksum (on CPU, each digest span
   is hashed on the digest threads as soon as the message holding it has
   arrived, overlapping the broadcast), stages the version and writes
   ``result/<seq>/<rank>``: ``ok`` or the reason it was refused.

``send`` returns once every receiver rank has staged the version; a corrupt
bucket, a missing receiver or a deadline is a ``WeightTransferError`` saying
which. ``receive`` on a receiver rank yields the newest staged version; on
the source rank it yields what it sent. Receiver ranks take every version
the source sends (a broadcast needs every rank), whether or not a
``receive`` is waiting.

NCCL (read against torch 2.13.0, never run here). Each rank's CUDA device is
chosen in the constructor's thread (``device=``, else ``LOCAL_RANK``, else
that thread's current device) and set in every helper thread that touches
the group, because a thread's current device defaults to 0. The group is
connected when it forms (``eager_connect_single_device``). A dead peer does
not fail an NCCL broadcast, it leaves it pending: each rank polls its works
until the transfer's deadline and then aborts the group (the pending kernels
exit, the process survives), so the transport is broken and must be rebuilt,
as after a failed gloo broadcast. Before each transfer the group's timeout
(all ``ProcessGroupNCCL`` honours) is set past that deadline, so NCCL's
watchdog, which would terminate the process, never fires first.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import TransferReport, TransportFeatures, WeightTransport, check_whole_version
from asyncflow_core.store.deployments.nccl_support import (
    DeviceSpec,
    abort_group,
    new_nccl_group,
    resolve_cuda_device,
    settle,
    use_device,
    watchdog_timeout_s,
)
from asyncflow_core.types import WeightBucket
from asyncflow_plugins.weight_transports.config import DistTransportConfig
from asyncflow_core.types.weights import (
    ExportArena,
    digest_leaf,
    digest_pool,
    digest_root,
    digest_spans,
    verify_buckets,
)
from asyncflow_plugins.weight_transports.manifest import (
    VersionManifest,
    buckets_from_payload,
    manifest_for,
    verify_all,
)

FEATURES = TransportFeatures(cross_process=True, cross_host=False, devices=("cpu", "cuda"))
KEY_PREFIX = "asyncflow/weights/"
_MIN_OP_TIMEOUT_S = 1.0


class Announcement(BaseModel):
    """``ann/<seq>``: what the source will broadcast."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=1, description="Transfer number, from 1.")
    chunk_bytes: int = Field(ge=1, description="Size of every broadcast message but the last.")
    timeout_s: float = Field(gt=0, description="Time the source has left for this transfer when it announced it.")
    weights: VersionManifest = Field(description="Tensor layout and checksums of the version.")


def chunk_ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` of pieces of at most ``chunk`` bytes covering ``total`` bytes, in order."""
    return [(start, min(start + chunk, total)) for start in range(0, total, chunk)]


def message_ranges(weights: VersionManifest, chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` in the payload of each broadcast message: every bucket in pieces of at most ``chunk``.

    Both sides compute it from the manifest. The padding between buckets is
    never sent (no digest covers it).
    """
    return [(e.offset + a, e.offset + b) for e in weights.buckets for a, b in chunk_ranges(e.nbytes, chunk)]


#: background threads still inside the group's constructor (waiting for peers), and until when they may wait
_JOINING: dict[threading.Thread, float] = {}
_JOINING_LOCK = threading.Lock()


@atexit.register
def _wait_for_joins() -> None:
    """At exit, let a join attempt that is still waiting for peers finish (it gives up at its join timeout).

    Such a thread is blocked in torch's C++ constructor with the GIL released;
    if the interpreter were already finalising when that call returns, the
    thread could not take the GIL back and the process would abort. atexit
    runs before finalisation, so waiting here (at most the join timeout
    left) lets the thread end cleanly.
    """
    with _JOINING_LOCK:
        pending = list(_JOINING.items())
    for thread, until in pending:
        thread.join(max(0.0, until - time.monotonic()) + 5.0)


class _Group:
    """The transport's rendezvous store (loopback only) and process group."""

    def __init__(self, config: DistTransportConfig, device: torch.device) -> None:
        timeout = timedelta(seconds=config.join_timeout_s)
        if config.rank == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", config.port))  # never 0.0.0.0: only local ranks can join
            listener.listen(128)
            port = listener.getsockname()[1]
            # the store owns the fd from here (its daemon polls it); Python must not close it under the daemon
            self.store = dist.TCPStore("127.0.0.1", port, config.world_size, True, timeout=timeout,
                                       master_listen_fd=listener.detach(), use_libuv=False)
        else:
            self.store = dist.TCPStore("127.0.0.1", config.port, config.world_size, False, timeout=timeout,
                                       use_libuv=False)
        self.kv = dist.PrefixStore(KEY_PREFIX, self.store)
        pg_store = dist.PrefixStore(KEY_PREFIX + "pg/", self.store)
        self.device = device
        if config.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupGloo(pg_store, config.rank, config.world_size, options)
        else:
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise WeightTransferError("backend='nccl' needs a torch build with NCCL; use backend='gloo'")
            # formed now, on this rank's own device (the caller's choice, set in this thread first)
            self.pg = new_nccl_group(pg_store, config.rank, config.world_size, device,
                                     timeout_s=watchdog_timeout_s(config.join_timeout_s),
                                     name=f"asyncflow-dist-weights-{config.port}")

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=max(timeout_s, _MIN_OP_TIMEOUT_S))  # gloo honours it; NCCL does not
        return self.pg.broadcast([tensor], opts)

    def bound_transfer(self, end: float) -> None:
        """NCCL: let the watchdog's timeout for the next works lie past ``end``, so :meth:`finish` aborts first.

        ``ProcessGroupNCCL`` gives each work its group's timeout when it is
        issued (``assignTimeoutToWork``) and ignores ``opts.timeout``.
        """
        if self.device.type == "cuda":
            self.pg.set_timeout(timedelta(seconds=watchdog_timeout_s(max(end - time.monotonic(), _MIN_OP_TIMEOUT_S))))

    def finish(self, works: list[Any], end: float, what: str) -> None:
        """Wait for ``works`` until ``end``. gloo: a dead peer fails them. NCCL: it would not, so past ``end``
        the group is aborted (its kernels exit, the process lives on) and the transfer fails."""
        if self.device.type != "cuda":
            for work in works:
                work.wait()
            return
        if not settle(works, end):
            abort_group(self.pg)
            raise WeightTransferError(f"{what} did not complete before the deadline (a rank died or stalled); "
                                      "the NCCL group was aborted")
        for work in works:
            work.wait()  # completed: orders this thread's stream after NCCL's and raises a recorded error
        torch.cuda.synchronize(self.device)


class DistWeightTransport(WeightTransport):
    """Broadcasts each version from ``source_rank`` to every other rank of its own loopback group."""

    def __init__(self, config: DistTransportConfig | None = None, *, device: DeviceSpec = None) -> None:
        """``device`` (NCCL only): this rank's CUDA device, an index or ``"cuda:N"``.

        Without it: ``LOCAL_RANK`` when set, else the current device of the
        thread constructing the transport. The choice is made here, in the
        caller's thread: the group is built and driven from helper threads,
        whose current device would be 0 on every rank.
        """
        self.config = config or DistTransportConfig()
        self.device = resolve_cuda_device(device) if self.config.backend == "nccl" else torch.device("cpu")
        self.is_source = self.config.rank == self.config.source_rank
        self._group: _Group | None = None
        self._joined = threading.Event()
        self._join_error: str | None = None
        self._broken: str | None = None  # set when a broadcast failed after all ranks committed to it
        self._stop = threading.Event()
        self._staged: tuple[int, list[WeightBucket]] | None = None
        self._failure: tuple[int, str] | None = None  # newest version this rank refused, and why
        self._seq = 0
        # receivers over gloo: payload buffers kept across versions (the staged one, the one coming in, and one an
        # engine may still be reading); NCCL keeps allocating (the use count does not see reads on other streams)
        self._buffers = ExportArena(max_slots=3) if (self.config.keep_buffers and not self.is_source
                                                     and self.device.type == "cpu") else None
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"asyncflow-dist-weights-{self.config.rank}",
                                        daemon=True)
        self._thread.start()

    @property
    def features(self) -> TransportFeatures:
        return FEATURES

    # --------------------------------------------------------- the background thread

    def _run(self) -> None:
        me = threading.current_thread()
        with _JOINING_LOCK:
            _JOINING[me] = time.monotonic() + self.config.join_timeout_s
        try:
            use_device(self.device)  # this thread builds the group and (receivers) listens on it
            self._group = _Group(self.config, self.device)
        except Exception as exc:  # noqa: BLE001 - reported by send/receive
            self._join_error = f"rank {self.config.rank} could not join the weight group on 127.0.0.1:" \
                               f"{self.config.port}: {exc}"
            return
        finally:
            with _JOINING_LOCK:
                _JOINING.pop(me, None)
            self._joined.set()
        if not self.is_source:
            try:
                self._listen(self._group)
            except Exception as exc:  # noqa: BLE001 - the store went away (source closed) or the group broke
                if not self._stop.is_set():
                    self._broken = f"the weight listener on rank {self.config.rank} stopped: {exc}"

    def _listen(self, group: _Group) -> None:
        """Receiver rank: take part in every announced transfer, in order."""
        seq = 1
        poll = self.config.poll_interval_s
        while not self._stop.is_set():
            key = f"ann/{seq}"
            if not group.kv.check([key]):
                time.sleep(poll)
                continue
            ann = Announcement.model_validate_json(group.kv.get(key))
            end = time.monotonic() + ann.timeout_s
            payload = self._payload_buffer(ann.weights.total_bytes, group.device)
            group.kv.set(f"ready/{seq}/{self.config.rank}", "1")
            state = self._decide(group, seq, end, propose_on_timeout="abort")
            if state == "go":
                self._receive_payload(group, ann, payload, end)
            else:
                self._failure = (ann.weights.version, (f"version {ann.weights.version} was announced but not "
                                 "broadcast: a rank missed the deadline before all had joined the transfer"))
            del payload  # a staged version holds its buffer; a refused or aborted one's is free again
            seq += 1

    def _payload_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The buffer a version is received into: a free kept one (gloo, ``keep_buffers``), else fresh memory.

        A kept buffer is free when nothing outside the arena uses it: no
        bucket, view or numpy array of the version it carried is held (the
        staged version is, so the next one goes into another buffer).
        """
        if self._buffers is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffers.allocator()(nbytes)

    def buffer_stats(self) -> dict[str, int] | None:
        """Receivers over gloo with ``keep_buffers``: the kept buffers' :meth:`ExportArena.stats`; else None."""
        return None if self._buffers is None else self._buffers.stats()

    def _decide(self, group: _Group, seq: int, end: float, *, propose_on_timeout: str) -> str:
        key = f"state/{seq}"
        while True:
            if group.kv.check([key]):
                return group.kv.get(key).decode()
            if self._stop.is_set() or time.monotonic() > end:
                return group.kv.compare_set(key, "", propose_on_timeout).decode()
            time.sleep(self.config.poll_interval_s)

    def _receive_payload(self, group: _Group, ann: Announcement, payload: torch.Tensor, end: float) -> None:
        version = ann.weights.version
        entries = ann.weights.buckets
        jobs = [(i, e.offset + a, e.offset + b) for i, e in enumerate(entries) for a, b in digest_spans(e.nbytes)]
        leaves: list[Any] = []
        try:
            group.bound_transfer(end)
            ranges = message_ranges(ann.weights, ann.chunk_bytes)
            works = [group.broadcast(payload[a:b], self.config.source_rank, end - time.monotonic()) for a, b in ranges]
            if group.device.type == "cpu":
                # gloo completes the broadcasts in order: hash each span once the message that ends it is in
                data = payload.numpy()
                pool = digest_pool()
                j = 0
                for work, (_, b) in zip(works, ranges, strict=True):
                    work.wait()
                    while j < len(jobs) and jobs[j][2] <= b:
                        leaves.append(pool.submit(digest_leaf, data[jobs[j][1] : jobs[j][2]]))
                        j += 1
                leaves += [pool.submit(digest_leaf, data[a:b]) for _, a, b in jobs[j:]]  # empty buckets at the end
            else:
                group.finish(works, end, f"the broadcast of version {version} to rank {self.config.rank}")
        except Exception as exc:
            self._broken = f"the broadcast of version {version} failed on rank {self.config.rank}: {exc}"
            with contextlib.suppress(Exception):
                group.kv.set(f"result/{ann.seq}/{self.config.rank}", self._broken)
            raise
        buckets = buckets_from_payload(ann.weights, payload)
        digests = None
        if leaves:
            per_bucket: list[list[bytes]] = [[] for _ in entries]
            for (i, _, _), leaf in zip(jobs, leaves, strict=True):
                per_bucket[i].append(leaf.result())
            digests = [digest_root(e.nbytes, p) for e, p in zip(entries, per_bucket, strict=True)]
        try:
            verify_buckets(buckets, where=f"received by rank {self.config.rank} over {self.config.backend}",
                           digests=digests)
        except WeightTransferError as exc:
            self._failure = (version, str(exc))
            group.kv.set(f"result/{ann.seq}/{self.config.rank}", str(exc))
            return
        if self._staged is None or version > self._staged[0]:
            self._staged = (version, buckets)
        group.kv.set(f"result/{ann.seq}/{self.config.rank}", "ok")

    # ------------------------------------------------------------------ send

    async def _wait_joined(self, deadline_s: float, what: str) -> _Group:
        if not self._joined.is_set():
            joined = await asyncio.to_thread(self._joined.wait, deadline_s)
            if not joined:
                raise WeightTransferError(
                    f"{what}: the ranks of the weight group (world_size {self.config.world_size}, port "
                    f"{self.config.port}) did not all join within the {deadline_s:g}s deadline"
                )
        if self._join_error:
            raise WeightTransferError(self._join_error)
        if self._broken:
            raise WeightTransferError(f"{self._broken}; the group cannot be used again: close and reopen the transport")
        assert self._group is not None
        return self._group

    async def send(self, buckets: AsyncIterable[WeightBucket], *, deadline_s: float) -> TransferReport:
        self._check_open()
        if not self.is_source:
            raise WeightTransferError(
                f"rank {self.config.rank} is a receiver; only source_rank {self.config.source_rank} sends"
            )
        start = time.perf_counter()
        end = time.monotonic() + deadline_s
        async with self._send_lock:
            group = await self._wait_joined(deadline_s, "send")
            try:
                async with asyncio.timeout(max(end - time.monotonic(), 0)):
                    received = [b async for b in buckets]
            except TimeoutError:
                raise WeightTransferError(f"weight send did not finish within its {deadline_s:g}s deadline") from None
            version = check_whole_version(received)
            if self._staged is not None and version <= self._staged[0]:
                raise WeightTransferError(
                    f"version {version} is not newer than the staged version {self._staged[0]}; versions must increase"
                )
            if self.config.world_size > 1:
                # the thread keeps to ``end`` itself (control waits poll it; broadcasts carry it as their timeout)
                await asyncio.to_thread(self._broadcast, group, received, end)
            self._staged = (version, received)
        return TransferReport(version=version, buckets=len(received), bytes=sum(b.nbytes for b in received),
                              seconds=time.perf_counter() - start)

    def _broadcast(self, group: _Group, buckets: list[WeightBucket], end: float) -> None:
        use_device(group.device)  # a fresh worker thread of asyncio.to_thread: its current device is 0
        cfg = self.config
        weights = manifest_for(buckets)
        self._seq += 1
        seq = self._seq
        receivers = [r for r in range(cfg.world_size) if r != cfg.source_rank]
        ann = Announcement(seq=seq, chunk_bytes=cfg.chunk_bytes, timeout_s=max(end - time.monotonic(), 1e-3),
                           weights=weights)
        group.kv.set(f"ann/{seq}", ann.model_dump_json())
        missing = self._wait_keys(group, [f"ready/{seq}/{r}" for r in receivers], end)
        if missing:
            state = group.kv.compare_set(f"state/{seq}", "", "abort").decode()
        else:
            state = group.kv.compare_set(f"state/{seq}", "", "go").decode()
        if state != "go":
            who = f"receiver ranks {[int(k.rsplit('/', 1)[1]) for k in missing]} did not" if missing else \
                "a receiver rank gave up on it (its deadline passed) before all could"
            raise WeightTransferError(f"version {weights.version} was not broadcast: {who} take part before the "
                                      "deadline; the previous version stays current")
        payload = self._payload_messages(buckets, weights, group.device)
        try:
            group.bound_transfer(end)
            works = [group.broadcast(msg, cfg.source_rank, end - time.monotonic()) for msg in payload]
            group.finish(works, end, f"the broadcast of version {weights.version} from the source rank")
        except Exception as exc:
            self._broken = f"the broadcast of version {weights.version} failed on the source rank: {exc}"
            raise WeightTransferError(self._broken) from exc
        results_keys = [f"result/{seq}/{r}" for r in receivers]
        missing = self._wait_keys(group, results_keys, end)
        if missing:
            raise WeightTransferError(f"receiver ranks {[int(k.rsplit('/', 1)[1]) for k in missing]} did not confirm "
                                      f"version {weights.version} before the deadline")
        refused = {r: group.kv.get(k).decode() for r, k in zip(receivers, results_keys, strict=True)}
        refused = {r: why for r, why in refused.items() if why != "ok"}
        for old in (f"ann/{seq}", *[f"ready/{seq}/{r}" for r in receivers], *results_keys, f"state/{seq}"):
            with contextlib.suppress(Exception):
                group.kv.delete_key(old)
        if refused:
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(refused.items()))
            raise WeightTransferError(f"version {weights.version} was refused by receivers: {detail}")

    def _wait_keys(self, group: _Group, keys: list[str], end: float) -> list[str]:
        """Poll until every key exists or ``end`` passes; returns the keys still missing."""
        pending = list(keys)
        while pending:
            pending = [k for k in pending if not group.kv.check([k])]
            if not pending or time.monotonic() > end:
                break
            time.sleep(self.config.poll_interval_s)
        return pending

    def _payload_messages(self, buckets: list[WeightBucket], weights: VersionManifest,
                          device: torch.device) -> list[torch.Tensor]:
        """The broadcast messages (:func:`message_ranges`): views of the bucket buffers, copied only to move device."""
        messages = []
        for entry, bucket in zip(weights.buckets, buckets, strict=True):
            buf = bucket.buffer.reshape(-1)
            if buf.device != device:
                buf = buf.to(device)
            messages += [buf[a:b] for a, b in chunk_ranges(entry.nbytes, self.config.chunk_bytes)]
        return messages

    # --------------------------------------------------------------- receive

    async def receive(self, *, min_version: int = 0, deadline_s: float) -> AsyncIterator[WeightBucket]:
        self._check_open()
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        await self._wait_joined(deadline_s, "receive")
        while True:
            staged = self._staged
            if staged is not None and staged[0] >= min_version:
                break
            failure = self._failure
            if failure is not None and failure[0] >= min_version:
                raise WeightTransferError(failure[1])
            if self._broken:
                raise WeightTransferError(self._broken)
            if loop.time() >= end:
                raise WeightTransferError(
                    f"no weight version >= {min_version} arrived on rank {self.config.rank} within {deadline_s:g}s "
                    f"(newest staged: {'none' if staged is None else staged[0]})"
                )
            await asyncio.sleep(self.config.poll_interval_s)
        _, buckets = staged
        if self.is_source:  # receivers verified on arrival; the source checks what it holds (free if it packed them)
            await asyncio.to_thread(verify_all, buckets, where=f"staged on source rank {self.config.rank}")
        for bucket in buckets:
            yield bucket

    # ----------------------------------------------------------------- close

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._joined.is_set():  # the listener notices the stop within a poll interval
            await asyncio.to_thread(self._thread.join, 10.0)
        # else the join attempt is still waiting for peers: it gives up by itself after join_timeout_s
        # (the thread is a daemon and finds the stop flag set if the peers do come)
        self._staged = None
        self._buffers = None
        group, self._group = self._group, None
        if group is not None:
            if not (self._broken and group.device.type == "cuda"):  # an aborted NCCL group has nothing to flush
                with contextlib.suppress(Exception):
                    group.pg.shutdown()
            del group

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError("the transport is closed")
