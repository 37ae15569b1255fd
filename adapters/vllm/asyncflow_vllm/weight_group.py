"""The weight group's transport choices and deadlines, shared by the engine and the worker extension.

The engine's process joins the weight group as rank 0 and vLLM's workers as
ranks 1..N. Two things here are easy to get wrong on a GPU, and are kept
apart from the code that moves bytes so they can be tested without one:

- **Which device rank 0 sends from.** NCCL refuses two ranks of one
  communicator on one GPU (``init.cc``: "Duplicate GPU detected", compared by
  PCI bus id), and vLLM's TP worker i runs on visible GPU i (``gpu_worker.py``
  ``Worker.init_device``), so the engine's process cannot simply use
  ``cuda:current_device()``. :func:`choose_weight_sync` compares devices by
  UUID (the same GPU has one UUID in every process, whatever
  ``CUDA_VISIBLE_DEVICES`` says) and picks a GPU no worker uses; with none
  free it falls back to gloo over CPU staging, which works with CUDA workers
  (they copy the received bytes into their parameters).
- **How an NCCL transfer ends at its deadline without ending the process.**
  torch 2.13's ``ProcessGroupNCCL`` (``ProcessGroupNCCL.hpp``/``.cpp``) has
  two ways to time out an operation, and both mark the operation failed:
  ``Work.wait(timeout)`` and the watchdog thread's check against
  ``Options._timeout``. The watchdog reacts to a failed operation by
  raising a process-wide dump flag (``shouldDump_``, a static shared by
  every group of the process); the heartbeat monitor of the process's first
  group then dumps and ends the process (``terminateProcess``) unless that
  group is shut down first — in a vLLM worker that first group is vLLM's
  own. And with the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (3,
  ``SkipCleanUp``) the watchdog rethrows on its own thread, which ends the
  process at once. So the adapter never lets an operation be marked
  failed for lateness: :func:`wait` polls ``Work.is_completed()`` until the
  deadline and then raises :class:`TransferTimeout` without touching the
  operation; the caller aborts the group (``ProcessGroupNCCL.abort``: stops
  the watchdog from checking, aborts the communicators, whose kernels then
  return, and stops the group's heartbeat monitor). ``Options._timeout`` is
  the deadline plus :data:`WATCHDOG_MARGIN_S`, a backstop that fires only if
  the abort never came; and the group is built with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (``CleanUpOnly``: the watchdog aborts
  the communicators and does not rethrow) for real NCCL errors such as a
  peer that died. torch reads that mode in the constructor only and offers
  no option for it, so :func:`nccl_group` sets it for that one call and
  restores the variable: vLLM's own groups keep their mode.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from asyncflow_core.errors import ConfigError

#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` value that aborts the failed group's communicators without killing the process
NCCL_CLEANUP_ONLY = "2"

#: How much later than the adapter's own deadline the NCCL watchdog's timeout fires (a backstop only)
WATCHDOG_MARGIN_S = 60.0

#: Polling interval of :func:`wait` (a weight bucket takes milliseconds to seconds to arrive)
_POLL_S = 0.002


class TransferTimeout(TimeoutError):
    """An operation of the weight group did not complete by the update's deadline (the group must be aborted)."""

_ENV_LOCK = threading.Lock()


def choose_weight_sync(
    backend: str,
    device: str,
    *,
    engine_device: str,
    local_uuids: Sequence[str],
    worker_uuids: Collection[str],
) -> tuple[str, str]:
    """(backend, device) of rank 0 of the weight group, or a ConfigError saying what to change.

    ``backend`` and ``device`` are the options ``weight_sync_backend``
    (auto / gloo / nccl) and ``weight_sync_device`` (auto / cpu / cuda:N);
    ``engine_device`` is where vLLM runs (cpu or cuda); ``local_uuids`` are
    the UUIDs of the GPUs this process sees, by index; ``worker_uuids`` those
    of the GPUs vLLM's workers run on.
    """
    if engine_device != "cuda" or backend == "gloo" or device == "cpu":
        if backend == "nccl":
            why = "vLLM runs on the CPU" if engine_device != "cuda" else "weight_sync_device is cpu"
            raise ConfigError(f"weight_sync_backend nccl needs GPUs, but {why}; use weight_sync_backend: gloo or auto")
        if device.startswith("cuda"):
            why = "vLLM runs on the CPU" if engine_device != "cuda" else "weight_sync_backend is gloo"
            raise ConfigError(f"weight_sync_device {device} needs the nccl backend, but {why}; set it to auto or cpu")
        return "gloo", "cpu"
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        if index >= len(local_uuids):
            raise ConfigError(
                f"weight_sync_device {device}: this process sees {len(local_uuids)} GPU(s) (cuda:0..cuda:"
                f"{len(local_uuids) - 1}); name one of them, or set it to auto"
            )
        if local_uuids[index] in worker_uuids:
            raise ConfigError(
                f"weight_sync_device {device} is a GPU one of vLLM's workers runs on, and NCCL refuses two ranks "
                "of one group on one GPU; name a GPU no worker uses, or set weight_sync_device: auto "
                "(which falls back to gloo when there is none)"
            )
        return "nccl", device
    free = [i for i, uuid in enumerate(local_uuids) if uuid not in worker_uuids]
    if free:
        return "nccl", f"cuda:{free[0]}"
    if backend == "nccl":
        raise ConfigError(
            f"weight_sync_backend nccl needs a GPU in this process that none of vLLM's workers runs on (NCCL refuses "
            f"two ranks of one group on one GPU), but all {len(local_uuids)} visible GPU(s) are the workers'; make "
            "one more GPU visible, or set weight_sync_backend: auto to send through the CPU (gloo)"
        )
    return "gloo", "cpu"


def cuda_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, by device index (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def remaining(deadline: float) -> datetime.timedelta:
    """Time left until ``deadline`` (``time.time()`` seconds), at least 1 ms: torch reads 0 as "no timeout"."""
    return datetime.timedelta(seconds=max(deadline - time.time(), 0.001))


def nccl_group(store: Any, rank: int, world_size: int, timeout_s: float, group_cls: Any = None) -> Any:
    """A ``ProcessGroupNCCL`` for transfers with a ``timeout_s`` deadline, whose failures do not end the process.

    ``group_cls`` defaults to ``torch.distributed.ProcessGroupNCCL`` (absent
    from CPU builds of torch; tests pass a stand-in).
    """
    if group_cls is None:
        from torch.distributed import ProcessGroupNCCL as group_cls
    options = group_cls.Options()
    options.is_high_priority_stream = False
    options._timeout = datetime.timedelta(seconds=timeout_s + WATCHDOG_MARGIN_S)
    with _ENV_LOCK:
        before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_CLEANUP_ONLY
        try:
            return group_cls(store, rank, world_size, options)
        finally:
            if before is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before


def wait(work: Any, backend: str, deadline: float) -> None:
    """Wait for one operation of the weight group; an NCCL one raises :class:`TransferTimeout` past ``deadline``.

    The NCCL operation is polled, not waited for with a timeout: a timed-out
    ``Work.wait(timeout)`` marks the operation failed, which sets off the
    process-wide dump and kill described in the module docstring. Once it
    is complete, ``Work.wait()`` makes the current CUDA stream wait for
    NCCL's (the received bytes are then safe to read) and raises an NCCL
    error if one came. gloo operations are bounded by the group's own
    timeout (its options) and are waited for as they are.
    """
    if backend != "nccl":
        work.wait()
        return
    while not work.is_completed():
        if time.time() >= deadline:
            raise TransferTimeout("an NCCL operation of the weight group was not complete at the update's deadline")
        time.sleep(_POLL_S)
    work.wait()


def abort(group: Any, backend: str) -> None:
    """Abort an NCCL group's communicators (local, never waits on the peers); gloo groups are just dropped."""
    if group is None or backend != "nccl":
        return
    # already aborted by a failed wait, or the process is going away: nothing more to do either way
    with contextlib.suppress(Exception):
        group.abort()


def from_rank_0() -> Any:
    """Broadcast options with rank 0 as the root."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts
