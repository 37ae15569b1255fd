"""Row gathers and scatters for the store's per-row tables, written so they never wait on a busy core.

``t[idx]`` and ``t[idx] = v`` with an int64 index go through torch's
advanced-indexing kernels, which split the work over the intra-op threads
even for a few thousand rows. On a host whose cores are busy (engines and
trainer ranks beside the store, or the development machine's other jobs) the
split waits for a descheduled thread: measured at 6 ms for a 10,922-row
gather with 2 threads against 27 µs on one thread, in the same minute, while
``index_select`` / ``index_copy_`` / ``index_fill_`` took 8-15 µs either way
(docs/performance.md, "Streaming store"). The store's control and data
tables use these helpers on every put, lease, read and ack.

CPU tables of a dtype numpy has go through numpy (views of the same memory,
fancy indexing on the calling thread), everything else through those torch
ops. Not for speed alone: every torch call releases the GIL, and in the
driver of a run the rollout engine's thread is waiting for it, so each call
on the store's path became a switch to that thread and a wait to get the GIL
back (docs/performance.md, "Against TRL's GRPOTrainer"). numpy keeps it.
"""

from __future__ import annotations

import numpy as np
import torch

try:  # numpy's C routine behind np.count_nonzero (axis None), without the Python dispatch wrapper around it:
    # 0.08 against 0.44 µs a call here, and the store's put/lease/read/ack loop makes a dozen
    from numpy._core.multiarray import count_nonzero
except ImportError:  # another numpy layout: the public function (the same result)
    count_nonzero = np.count_nonzero

#: dtypes whose tensors the helpers index through numpy (``Tensor.numpy()`` shares their memory)
_NUMPY = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                    torch.float32, torch.float16})


def _numpy_ok(t: torch.Tensor, idx: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and idx.device.type == "cpu" and t.dtype in _NUMPY and not t.requires_grad
            and t.dim() > 0)


def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` along the first axis (a new tensor) for an int64 index."""
    if _numpy_ok(t, idx):
        return torch.from_numpy(t.numpy()[idx.numpy()])
    return t.index_select(0, idx)


def assign(t: torch.Tensor, idx: torch.Tensor, value: torch.Tensor | int | float | bool) -> None:
    """``t[idx] = value`` along the first axis for an int64 index without repeats (a tensor or a scalar)."""
    if _numpy_ok(t, idx) and (not isinstance(value, torch.Tensor)
                              or (value.device.type == "cpu" and value.dtype in _NUMPY and not value.requires_grad)):
        arr = t.numpy()
        if isinstance(value, torch.Tensor):
            # the target's dtype, as index_copy_ needs (a bool into int64, an int64 into bool: torch's casts)
            value = (value if value.dtype == t.dtype else value.to(t.dtype)).numpy()
        elif isinstance(value, bool) or arr.dtype == np.bool_:
            value = bool(value) if arr.dtype == np.bool_ else int(value)
        arr[idx.numpy()] = value
        return
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        t.index_fill_(0, idx, value)
        return
    if value.dtype != t.dtype:
        value = value.to(t.dtype)
    want = (idx.numel(), *t.shape[1:])
    if tuple(value.shape) != want:
        value = value.expand(want)
    t.index_copy_(0, idx, value)


def where(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the True entries of a 1-D bool mask (int64), for :func:`take` instead of ``t[mask]``."""
    if mask.device.type == "cpu" and mask.dim() == 1:
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().squeeze(1)
