"""The log-prob convention every rollout engine and trainer shares (see ``SamplingParams``).

A token's log-prob is taken under the distribution it was sampled from:
logits / temperature, then top-k, then top-p (nucleus), renormalised. Engines
that score tokens (the trainer's ``compute_logprobs``, a rollout engine's
returned log-probs) call this one function so the two sides cannot drift.
"""

from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """Log-probs of the distribution tokens are sampled from: temperature, then top-k, then top-p, renormalised.

    Tokens cut by top-k/top-p get ``-inf``. ``logits`` is ``[..., vocab]``.
    """
    scaled = logits / temperature
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = (cum - sorted_logp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp
