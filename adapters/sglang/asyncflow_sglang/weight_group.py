"""The weight-update process group between this process (rank 0) and an SGLang server's ranks.

SGLang's ``/init_weights_update_group`` makes every server rank join a
torch.distributed group with ``init_custom_process_group``
(``python/sglang/srt/utils/common.py``, the same in 0.5.6 and 0.5.20 to
0.5.23): a TCP rendezvous at ``init_method = tcp://{master_address}:{master_port}``
as rank ``rank_offset + tp_rank``, the store wrapped in
``PrefixStore(group_name, store)``, then torch's
``_new_process_group_helper(world_size, rank, [], backend, store,
group_name=group_name)``. Rank 0 (the sender) must wrap its store with the
same prefix so that both sides look for the same store keys; :func:`join`
does that. (The protocol fake joins through its own rendering of SGLang's
convention, in :mod:`asyncflow_sglang.testing`, not through this module.)

The sender hosts the rendezvous store itself (port 0: the OS picks a free
port, no probe-then-bind race) and tells the server its port.
"""

from __future__ import annotations

import inspect
import os
import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist


def host_store(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, hosted by rank 0 on ``address`` and a free port (read it from ``.port``).

    A TCPStore given only a port listens on every interface; here the
    listening socket is bound to ``address`` first and handed to the store,
    so a loopback address keeps the rendezvous on loopback.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # the store's daemon thread polls this fd for the life of the process: Python must never close it
    fd = listener.detach()
    return dist.TCPStore(address, port, world_size, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd, use_libuv=False)


def keep_on_loopback(address: str) -> None:
    """When the group's address is loopback, make gloo's and NCCL's own sockets use the loopback interface too.

    Process-wide and only when unset (as the project's other loopback groups do).
    """
    if address not in ("127.0.0.1", "localhost", "::1"):
        return
    names = {name for _, name in socket.if_nameindex()}
    for candidate in ("lo", "lo0"):
        if candidate in names:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", candidate)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", candidate)
            return


def join(
    *,
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join the group as ``rank`` (blocks until every rank has joined or ``timeout_s`` passes).

    ``store`` is rank 0's hosted store; other ranks rendezvous through
    ``init_method``. The group is not the default group, so this works in a
    process that has (or has not) initialised torch.distributed otherwise.
    The store is prefixed with ``group_name``, as SGLang's ranks prefix theirs.
    """
    from torch.distributed import distributed_c10d as c10d

    keep_on_loopback(urlparse(init_method).hostname or "")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    # the prefix SGLang's init_custom_process_group puts on its ranks' store, so both sides meet on the same keys
    prefixed = dist.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, prefixed, group_name=group_name, timeout=timeout, **options
    )
    # rank translation for torch.distributed.broadcast(..., group=pg): group ranks are global ranks here
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` from rank 0, one collective per tensor, in order (what SGLang receives)."""
    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)


def destroy(group: dist.ProcessGroup) -> None:
    """Free the group's communicators and its registration (best effort: the peer may be gone)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a group whose peer died cannot always be torn down cleanly
        pass
