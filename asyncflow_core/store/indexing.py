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
"""

from __future__ import annotations

import torch


def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` along the first axis (a new tensor) for an int64 index."""
    return t.index_select(0, idx)


def assign(t: torch.Tensor, idx: torch.Tensor, value: torch.Tensor | int | float | bool) -> None:
    """``t[idx] = value`` along the first axis for an int64 index without repeats (a tensor or a scalar)."""
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
    return mask.nonzero().squeeze(1)
