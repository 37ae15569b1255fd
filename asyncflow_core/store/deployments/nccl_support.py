"""Which CUDA device a rank uses, and NCCL groups that can be given up on without taking the process down.

Shared by the ``distributed`` store (:mod:`.distributed`, :mod:`.p2p`) and the
``dist`` weight transport. Written against torch 2.13.0 (its
``distributed_c10d.py``, ``_C/_distributed_c10d.pyi`` and the shipped
``ProcessGroupNCCL.hpp``) and a recent upstream ``ProcessGroupNCCL.cpp``
(``WorkNCCL::isCompleted``/``wait``, ``assignTimeoutToWork``,
``Watchdog::runLoop``, ``abort``, ``eagerConnectSingleDevice``; not the
v2.13.0 tag itself), never run on a GPU here:

- The current CUDA device is per *thread*. A thread that never called
  ``torch.cuda.set_device`` is on device 0, so a group built or driven from a
  helper thread lands every rank on ``cuda:0`` unless that thread sets the
  device itself. :func:`select_cuda_device` picks the device once (from an
  explicit choice, ``LOCAL_RANK`` or the *calling* thread's current device)
  and :func:`use_device` sets it in each thread that touches NCCL.
- ``ProcessGroupNCCL`` uses only its group's ``Options._timeout`` for the
  watchdog (``assignTimeoutToWork``); a per-call ``opts.timeout`` is ignored.
  With the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (SkipCleanUp) a work
  that outlives that timeout makes the watchdog *terminate the process*.
- A peer that died leaves a posted NCCL send/receive pending forever:
  ``work.wait()`` only makes the current stream wait, and a stream
  synchronize then blocks for good. So callers poll ``work.is_completed()``
  (a CUDA event query, never blocking) up to their own deadline
  (:func:`settle`) and, past it, call the group's ``abort()``
  (:func:`abort_group`): ``ProcessGroupNCCL::abort`` sets
  ``terminateProcessGroup_`` *before* aborting the communicators, so the
  watchdog stops checking NCCL errors (no teardown), and ``ncclCommAbort``
  makes the pending kernels exit. The group's own timeout is set well past
  the caller's deadline (:func:`watchdog_timeout_s`) so that the abort always
  comes first. (An NCCL *error*, as opposed to a hang, is still fatal under
  the default error handling: the watchdog sees it before anyone can abort.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncflow_core.errors import ConfigError

LOCAL_RANK_ENV = "LOCAL_RANK"
DeviceSpec = int | str | torch.device | None

_POLL_START_S = 0.0005
_POLL_MAX_S = 0.01
_WATCHDOG_MARGIN_S = 60.0

#: aborted groups, kept referenced: their C++ destructor joins the watchdog thread and must not run on a caller's thread
_ABORTED: list[Any] = []
_ABORTED_LOCK = threading.Lock()


# ============================================================================ device choice


def select_cuda_device(explicit: DeviceSpec, *, local_rank: str | None, current: int,
                       device_count: int) -> torch.device:
    """This rank's CUDA device: ``explicit`` if given, else ``LOCAL_RANK``, else the calling thread's device.

    Pure: the caller passes what it read, so the choice is testable without a
    GPU. ``current`` must be ``torch.cuda.current_device()`` *in the thread
    the user configured* (the constructor's thread), never a helper thread's
    (which is 0). ``LOCAL_RANK`` beyond the visible devices is accepted only
    when exactly one device is visible (one GPU per process through
    ``CUDA_VISIBLE_DEVICES``: it is ``cuda:0``). Raises :class:`ConfigError`
    with the fix when the choice cannot be honoured.
    """
    if device_count < 1:
        raise ConfigError("NCCL needs a CUDA device and this process sees none; use the gloo backend on CPU")
    if explicit is not None:
        device = _parse_device(explicit)
        if device.index is None:
            device = torch.device("cuda", current)
        if not 0 <= device.index < device_count:
            raise ConfigError(f"device {device} does not exist: this process sees {device_count} CUDA device(s) "
                              f"(indices 0..{device_count - 1}, after CUDA_VISIBLE_DEVICES)")
        return device
    if local_rank is not None and local_rank.strip() != "":
        try:
            index = int(local_rank)
        except ValueError:
            raise ConfigError(f"{LOCAL_RANK_ENV}={local_rank!r} is not an integer; unset it or pass device=...") \
                from None
        if index < 0:
            raise ConfigError(f"{LOCAL_RANK_ENV}={index} is negative; unset it or pass device=...")
        if index < device_count:
            return torch.device("cuda", index)
        if device_count == 1:
            return torch.device("cuda", 0)
        raise ConfigError(f"{LOCAL_RANK_ENV}={index} but this process sees {device_count} CUDA devices; pass "
                          "device='cuda:N' or give each process one device with CUDA_VISIBLE_DEVICES")
    if not 0 <= current < device_count:
        raise ConfigError(f"the current CUDA device {current} is not one of the {device_count} visible devices")
    return torch.device("cuda", current)


def _parse_device(spec: int | str | torch.device) -> torch.device:
    if isinstance(spec, bool):
        raise ConfigError(f"device must be an index or 'cuda:N', got {spec!r}")
    if isinstance(spec, int):
        return torch.device("cuda", spec)
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {spec!r} is not a device; use an index or 'cuda:N'") from None
    if device.type != "cuda":
        raise ConfigError(f"device {spec!r} is not a CUDA device; NCCL moves CUDA tensors ('cuda:N')")
    return device


def resolve_cuda_device(explicit: DeviceSpec = None) -> torch.device:
    """:func:`select_cuda_device` with what this process and the *calling* thread see now."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    current = torch.cuda.current_device() if count else 0
    return select_cuda_device(explicit, local_rank=os.environ.get(LOCAL_RANK_ENV), current=current,
                              device_count=count)


def use_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling thread (no-op for the CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


# ============================================================================ NCCL groups


def watchdog_timeout_s(deadline_s: float) -> float:
    """The NCCL group timeout for callers that give up after ``deadline_s``: late enough that they abort first."""
    return 2.0 * deadline_s + _WATCHDOG_MARGIN_S


def new_nccl_group(store: Any, rank: int, size: int, device: torch.device, *, timeout_s: float,
                   name: str) -> Any:
    """A ``ProcessGroupNCCL`` on ``device``, connected now (blocks until every rank of it calls this).

    Run it in the thread that will drive the group or in a dedicated one: it
    sets that thread's CUDA device first. ``eager_connect_single_device``
    creates the communicator at once (torch 2.13: ``initNCCLComm`` then
    ``eagerInit_``), so later send/recv reuse it instead of creating a pair
    communicator lazily on the issuing thread.
    """
    use_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    options.group_name = name
    group = dist.ProcessGroupNCCL(store, rank, size, options)
    group.eager_connect_single_device(device)
    return group


def abort_group(group: Any) -> None:
    """Abort every communicator of ``group`` (pending kernels exit); the group is unusable afterwards.

    ``Backend.abort`` / ``ProcessGroupNCCL::abort`` at torch 2.13: marks the
    group terminated (the watchdog stops raising for it), aborts the
    communicators and waits at most the group timeout for that. The group
    stays referenced here for the life of the process.
    """
    with _ABORTED_LOCK:
        _ABORTED.append(group)
    group.abort()


def settle(works: Sequence[Any], end: float, *, clock: Callable[[], float] = time.monotonic,
           pause: Callable[[float], None] = time.sleep) -> bool:
    """Poll until every work completed (True) or ``end`` passed (False); never blocks on a work.

    ``is_completed`` on an NCCL work queries its end event (and, while the
    communicator is not aborted, its async error), so a work whose peer died
    is observed, not waited on. A completed work still has to be ``wait()``-ed
    by the caller to order its stream and surface a recorded error.
    """
    delay = _POLL_START_S
    while True:
        if all(w.is_completed() for w in works):
            return True
        if clock() >= end:
            return False
        pause(delay)
        delay = min(delay * 2, _POLL_MAX_S)


__all__ = ["abort_group", "new_nccl_group", "resolve_cuda_device", "select_cuda_device", "settle", "use_device",
           "watchdog_timeout_s"]
