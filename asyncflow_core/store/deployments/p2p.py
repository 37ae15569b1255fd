"""The distributed store's point-to-point engine: one ordered lane per peer, issued on one thread, waited on a pool.

Every transfer with a peer travels on that peer's *lane*. The server hands
out sequence numbers per lane (:meth:`P2PLink.post`) and a client issues its
side in that order (:meth:`P2PLink.post_at`), so both sides issue a lane's
operations in the same order from one thread each (NCCL matches a pair's
operations in issue order; gloo matches tags, which are the sequence numbers).

Two kinds of lanes:

- **shared** (generation 0): every lane uses the store's process group. This
  is the gloo (CPU) data plane: a peer that dies fails a gloo receive, so a
  wait simply ends. (Pair groups can be forced on the CPU, over gloo: waits
  then block the same way; the tests run the lane protocol like that.)
- **pair groups** (generation >= 1): each lane is a 2-rank process group of
  its own: server rank 0, client rank 1, formed on request (the server tells
  the client a generation and a fresh rendezvous key; both sides connect on
  a dedicated thread). This is the CUDA data plane: a dead NCCL peer leaves a
  posted receive pending forever and the group's watchdog would terminate the
  process at the group's timeout. Waits therefore poll until their own
  deadline and then *abort the lane's group* (its kernels exit, the process
  lives on, no other peer and not the user's process group is touched); the
  lane is marked broken and the next transfer forms a new generation. The
  group's timeout is set past that deadline (:func:`.nccl_support.watchdog_timeout_s`).

After an abort, memory that a pending receive could still write (the server's
arena) is reused only once that receive is seen to have ended; errors raised
by :meth:`P2PLink.wait` say which (:func:`memory_in_use`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncflow_core.store.deployments.nccl_support import (
    abort_group,
    new_nccl_group,
    settle,
    use_device,
    watchdog_timeout_s,
)
from asyncflow_core.store.errors import StoreClosedError, StoreTimeoutError

KEY_PREFIX = "asyncflow/store/lane/"
ABORT_SETTLE_S = 5.0  #: after an abort, how long pending kernels get to exit before their memory is written off

Op = tuple[str, torch.Tensor]


def memory_in_use(exc: BaseException) -> bool:
    """True when a failed wait left a receive possibly still writing into its buffers (do not reuse them)."""
    return bool(getattr(exc, "memory_in_use", False))


def _kv_store() -> Any:
    return dist.distributed_c10d._get_default_store()


@dataclass(eq=False)
class Lane:
    """The ordered path to one peer: its sequence numbers and, for pair groups, the group itself."""

    peer: int  #: the other side's global rank
    gen: int = 0  #: 0: the shared group; >= 1: the pair group's generation
    key: str = ""  #: rendezvous prefix of the pair group
    pair_rank: int = 0  #: this side's rank in the pair group (server 0, client 1)
    group: Any = None  #: the pair group once formed
    formed: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    broken: str | None = None  #: why the lane was given up (no new operation is issued on it)
    aborted: bool = False
    #: waits poll ``is_completed`` and abort past their deadline (NCCL); else they block in ``wait()`` (gloo, whose
    #: works report completion only from ``wait()``, and whose dead peers fail them)
    polls: bool = False
    next_seq: int = 0  #: server: next sequence number to hand out
    expect: int = 0  #: client: next sequence number to issue
    parked: dict[int, tuple[list, Any]] = field(default_factory=dict)  #: client: posted ahead of their turn

    @property
    def other(self) -> int:
        return 1 - self.pair_rank

    def describe(self) -> dict[str, Any]:
        return {"gen": self.gen, "key": self.key}


class P2PLink:
    """This process's point-to-point engine for one process group (shared by every store in the process).

    ``pair_groups``: None gives each lane its own group exactly when the data
    plane is CUDA (NCCL); True forces pair groups on the CPU too (gloo pairs:
    how the tests run the NCCL protocol without a GPU). The server decides;
    clients follow what it answers.
    """

    def __init__(self, group: Any, device: torch.device, *, pair_groups: bool | None = None) -> None:
        self.group = group
        self.device = device
        self.pair_groups = device.type == "cuda" if pair_groups is None else pair_groups

        def init() -> None:
            use_device(device)  # every pool thread drives NCCL on this rank's device, not on its default 0

        self._issuer = ThreadPoolExecutor(1, thread_name_prefix="asyncflow-p2p-issue", initializer=init)
        self._waiters = ThreadPoolExecutor(8, thread_name_prefix="asyncflow-p2p-wait", initializer=init)
        self._lock = threading.Lock()
        self._lanes: dict[tuple[str, int], Lane] = {}
        self._last_gen: dict[int, int] = {}
        self.pg: Any = None

    # -- lanes -----------------------------------------------------------------------

    def serve_lane(self, peer: int, *, client_broken: int | None, timeout_s: float) -> Lane:
        """Server: the lane to use with ``peer`` now.

        With pair groups, a missing or broken lane (or the one the client
        reports broken, ``client_broken``) is replaced by a new generation
        whose formation starts at once; the caller compares its generation
        with the client's and, when they differ, answers with
        :meth:`Lane.describe` instead of transferring.
        """
        stale: Lane | None = None
        with self._lock:
            lane = self._lanes.get(("serve", peer))
            if not self.pair_groups:
                if lane is None:
                    lane = self._lanes[("serve", peer)] = self._shared(peer)
                return lane
            if lane is not None and lane.broken is None and client_broken == lane.gen:
                lane.broken = f"rank {peer} gave up on lane {lane.gen}"
                stale = lane
            if lane is None or lane.broken is not None:
                gen = self._last_gen[peer] = self._last_gen.get(peer, 0) + 1
                lane = Lane(peer, gen=gen, key=f"{KEY_PREFIX}{uuid.uuid4().hex}/", pair_rank=0)
                self._lanes[("serve", peer)] = lane
                self._start_forming(lane, timeout_s)
        if stale is not None:
            self.abort_later(stale, stale.broken or "")
        return lane

    def shared_lane(self, role: str, peer: int) -> Lane:
        """The generation-0 lane (the store's own process group) to ``peer`` in ``role`` ("serve" or "use")."""
        with self._lock:
            lane = self._lanes.get((role, peer))
            if lane is None or lane.gen != 0:
                lane = self._lanes[(role, peer)] = self._shared(peer)
            return lane

    def client_lane(self, server: int) -> Lane | None:
        """Client: the lane to ``server`` (None before the server assigned one); may be broken."""
        with self._lock:
            return self._lanes.get(("use", server))

    def join_lane(self, server: int, gen: int, key: str, *, timeout_s: float) -> Lane:
        """Client: the lane the server assigned (``gen``, ``key``), forming this side of it if new."""
        replaced: Lane | None = None
        with self._lock:
            lane = self._lanes.get(("use", server))
            if lane is not None and lane.gen == gen:
                return lane
            if lane is not None and lane.broken is None:  # the server moved on: this side is of no use any more
                lane.broken = f"the server rank replaced lane {lane.gen} by lane {gen}"
                replaced = lane
            lane = self._lanes[("use", server)] = Lane(server, gen=gen, key=key, pair_rank=1)
            self._start_forming(lane, timeout_s)
        if replaced is not None:
            self.abort_later(replaced, replaced.broken or "")
        return lane

    async def formed(self, lane: Lane, timeout_s: float) -> None:
        """Wait (off the event loop) until ``lane`` can carry transfers; a lane that does not form is broken."""
        if not lane.formed.done():
            loop = asyncio.get_running_loop()
            done, _ = await loop.run_in_executor(
                self._waiters, lambda: concurrent.futures.wait([lane.formed], timeout=timeout_s))
            if not done:
                why = f"the pair group with rank {lane.peer} (lane {lane.gen}) did not form within {timeout_s:g}s"
                self.abort_later(lane, why)
                raise StoreTimeoutError(f"{why}; is that rank alive and on its own CUDA device?")
        if lane.broken is not None:
            raise StoreClosedError(f"lane {lane.gen} with rank {lane.peer} is unusable: {lane.broken}")
        lane.formed.result()

    def _shared(self, peer: int) -> Lane:
        lane = Lane(peer)
        lane.formed.set_result(None)
        return lane

    def _start_forming(self, lane: Lane, timeout_s: float) -> None:
        thread = threading.Thread(target=self._form, args=(lane, timeout_s), daemon=True,
                                  name=f"asyncflow-p2p-form-{lane.peer}-{lane.gen}")
        thread.start()

    def _form(self, lane: Lane, timeout_s: float) -> None:
        """Connect this side of ``lane``'s pair group (blocks until the peer connects too)."""
        try:
            store = dist.PrefixStore(lane.key, _kv_store())
            name = f"asyncflow-store-lane-{lane.key.rstrip('/').rsplit('/', 1)[-1][:12]}"
            if self.device.type == "cuda":
                group = new_nccl_group(store, lane.pair_rank, 2, self.device,
                                       timeout_s=watchdog_timeout_s(timeout_s), name=name)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                options._timeout = timedelta(seconds=timeout_s)
                group = dist.ProcessGroupGloo(store, lane.pair_rank, 2, options)
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the lane
            with self._lock:
                lane.broken = lane.broken or f"its pair group could not form: {exc}"
            lane.formed.set_exception(exc)
            return
        with self._lock:
            lane.group = group
            lane.polls = self.device.type == "cuda"
            given_up = lane.broken is not None
        lane.formed.set_result(None)
        if given_up:  # abandoned while it formed
            self._abort(lane)

    def abort_later(self, lane: Lane, why: str) -> None:
        """Mark ``lane`` broken now and abort its group on a thread of its own (abort may block)."""
        with self._lock:
            lane.broken = lane.broken or why
        threading.Thread(target=self._abort, args=(lane,), daemon=True, name="asyncflow-p2p-abort").start()

    def _abort(self, lane: Lane) -> None:
        with self._lock:
            if lane.aborted or lane.group is None:
                return  # already done, or still forming (its thread aborts it once formed)
            lane.aborted = True
            group = lane.group
        with contextlib.suppress(Exception):
            abort_group(group)

    # -- issuing -------------------------------------------------------------------

    def _issue(self, lane: Lane, ops: list[tuple[str, torch.Tensor, int]]) -> list[Any]:
        if lane.broken is not None:
            raise StoreClosedError(f"lane {lane.gen} with rank {lane.peer} is unusable: {lane.broken}")
        works = []
        for kind, tensor, tag in ops:
            if lane.gen == 0:
                fn = dist.isend if kind == "send" else dist.irecv
                works.append(fn(tensor, lane.peer, group=self.group, tag=tag))
            elif kind == "send":
                works.append(lane.group.send([tensor], lane.other, tag))
            else:
                works.append(lane.group.recv([tensor], lane.other, tag))
        return works

    def post(self, lane: Lane, ops: list[Op]) -> tuple[int, asyncio.Future]:
        """Server side: take the next sequence numbers of ``lane`` and issue ``ops`` (tags = those numbers).

        Returns the first sequence number and an asyncio future of the works.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            seq = lane.next_seq
            lane.next_seq = seq + len(ops)
            cf = self._issuer.submit(self._issue, lane, [(k, t, seq + i) for i, (k, t) in enumerate(ops)])
        return seq, asyncio.wrap_future(cf, loop=loop)

    def post_at(self, lane: Lane, seq: int, ops: list[Op]) -> asyncio.Future:
        """Client side: issue ``ops`` as sequence numbers ``seq, seq+1, ...`` once every earlier one was issued."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def resolve(cf: Any) -> None:
            def set_() -> None:
                if done.done():
                    return
                if cf.exception() is not None:
                    done.set_exception(cf.exception())
                else:
                    done.set_result(cf.result())

            loop.call_soon_threadsafe(set_)

        with self._lock:
            lane.parked[seq] = ([(k, t, seq + i) for i, (k, t) in enumerate(ops)], resolve)
            nxt = lane.expect
            while nxt in lane.parked:
                ready, cb = lane.parked.pop(nxt)
                self._issuer.submit(self._issue, lane, ready).add_done_callback(cb)
                nxt += len(ready) or 1
            lane.expect = nxt
        return done

    # -- waiting -------------------------------------------------------------------

    async def wait(self, works: list[Any], lane: Lane, *, timeout_s: float) -> None:
        """Wait (off the event loop) until every work completed; raises the first failure.

        gloo: ``work.wait()`` (a dead gloo peer fails it). NCCL pair group:
        poll up to ``timeout_s``, then abort the lane (see the module notes);
        the error then carries ``memory_in_use`` when a receive may still write.
        """
        await asyncio.wrap_future(self._waiters.submit(self._block, works, lane, timeout_s))

    async def settle_or_abort(self, works: list[Any], lane: Lane, *, grace_s: float) -> bool:
        """The peer is gone: True once ``works`` ended (their buffers may be reused), within ``grace_s`` or after
        aborting the lane; False when they still had not ended after the abort (write the buffers off)."""
        if not lane.polls:
            def block_shared() -> bool:
                for w in works:
                    with contextlib.suppress(Exception):  # a dead gloo peer fails them: that is the end we wait for
                        w.wait()
                return True

            return await asyncio.wrap_future(self._waiters.submit(block_shared))

        def block() -> bool:
            if settle(works, time.monotonic() + grace_s):
                return True
            with self._lock:
                lane.broken = lane.broken or f"rank {lane.peer} left with a transfer in flight"
            self._abort(lane)  # here, not on another thread: the settle below needs the kernels told to exit
            return settle(works, time.monotonic() + min(ABORT_SETTLE_S, grace_s))

        return await asyncio.wrap_future(self._waiters.submit(block))

    def _block(self, works: list[Any], lane: Lane, timeout_s: float) -> None:
        if not lane.polls:
            for w in works:
                w.wait()
        else:
            if not settle(works, time.monotonic() + timeout_s):
                why = f"a transfer with rank {lane.peer} did not complete within {timeout_s:g}s"
                with self._lock:
                    lane.broken = lane.broken or why
                self._abort(lane)
                err = StoreTimeoutError(f"{why}; its lane was aborted and the next transfer forms a new one")
                ended = settle(works, time.monotonic() + min(ABORT_SETTLE_S, timeout_s))
                err.memory_in_use = not ended  # type: ignore[attr-defined]
                raise err
            if lane.broken is not None:  # ended because the lane was aborted: the data is not whole
                raise StoreClosedError(f"lane {lane.gen} with rank {lane.peer} was given up: {lane.broken}")
            for w in works:
                w.wait()  # completed: orders this thread's stream after the group's and raises a recorded error
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def shutdown(self) -> None:
        self._issuer.shutdown(wait=False)
        self._waiters.shutdown(wait=False)


_LINKS: dict[int, P2PLink] = {}
_LINKS_LOCK = threading.Lock()


def link_for(group: Any, device: torch.device, *, pair_groups: bool | None = None) -> P2PLink:
    """The process's :class:`P2PLink` for ``group`` (one per group, shared by every store).

    ``pair_groups`` counts only when the link is created (the server's host creates it first on its rank).
    """
    # keyed by the group object (kept alive by the link): a re-initialised default group gets fresh sequences
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    with _LINKS_LOCK:
        link = _LINKS.get(id(pg))
        if link is None or link.pg is not pg:
            link = _LINKS[id(pg)] = P2PLink(group, device, pair_groups=pair_groups)
            link.pg = pg
        return link


__all__ = ["Lane", "P2PLink", "link_for", "memory_in_use"]
