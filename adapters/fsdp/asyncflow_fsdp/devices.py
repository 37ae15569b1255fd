"""Which CUDA device a rank uses (shared with the ``megatron`` adapter's ranks)."""

from __future__ import annotations

import torch


def rank_device(rank: int, visible_devices: int) -> torch.device:
    """The CUDA device of ``rank`` among the ``visible_devices`` this rank's process sees.

    A rank group lives on one host (the core's rank group: child processes,
    or Ray actors that must share one node), so the global rank is the local
    rank. Child processes see every GPU of the host: rank r takes GPU r. A Ray
    rank actor sees only the GPU Ray gave it (``CUDA_VISIBLE_DEVICES``), so
    ``rank % 1`` is its device 0. Call this, then ``torch.cuda.set_device``,
    before anything allocates on CUDA: otherwise every rank's first allocation
    (and NCCL's communicator) lands on GPU 0.
    """
    if visible_devices < 1:
        raise RuntimeError(f"rank {rank} sees no CUDA device (torch.cuda.device_count() is 0); check "
                           "CUDA_VISIBLE_DEVICES, or use device: cpu")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return torch.device("cuda", rank % visible_devices)
