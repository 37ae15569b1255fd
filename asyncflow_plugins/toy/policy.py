"""The toy policy: a bigram table, ``logits[next] = W[prev]``.

Small enough to train in milliseconds on a CPU, rich enough to exercise every
contract for real: sampling with temperature / top-p / top-k, per-token
log-probs, bucketed weight export and in-place loading. The rollout and the
train engine share this file; the log-prob convention itself is
``asyncflow_core.types.sampling.sampling_logprobs``, shared by every engine.
"""

from __future__ import annotations

import torch

from asyncflow_core.types.sampling import sampling_logprobs  # noqa: F401  (the shared convention)

PARAM_NAME = "bigram.weight"


def initial_table(vocab_size: int, seed: int, init_scale: float) -> torch.Tensor:
    """The version-0 weights both toy engines start from (same seed -> same table)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, vocab_size, generator=gen) * init_scale
