"""The simulated policy's numbers: token ids, per-token log-probs, per-request random draws.

Nothing here models language. What matters is that (a) results are cheap to
make at 10^5 samples — token ids and log-probs are tensor slices of buffers
built once per seed — and (b) the rollout engine and the trainer agree: the
log-prob of token ``t`` under version ``v`` is :func:`token_logprobs` on both
sides, so on-policy importance ratios are exactly 1 and stale tokens show a
small, version-dependent drift, as they would on a real model.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

import torch

#: Length of the shared token buffer; results are cyclic slices of it.
BUFFER_TOKENS = 1 << 17


def request_uniform(seed: int, request_id: str) -> tuple[float, int]:
    """``(u, offset)``: a uniform number in (0, 1) and a buffer offset, both a pure function of the inputs."""
    digest = hashlib.blake2b(f"{seed}\x00{request_id}".encode(), digest_size=16).digest()
    a = int.from_bytes(digest[:8], "little")
    b = int.from_bytes(digest[8:], "little")
    return (a + 0.5) / 2.0**64, b % BUFFER_TOKENS


@lru_cache(maxsize=8)
def _token_table(policy_seed: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(policy_seed)
    # base: how confident the policy is on each token (mean log-prob ~ -0.35: low-entropy reasoning text)
    base = -torch.empty(vocab_size, dtype=torch.float64).exponential_(1 / 0.35, generator=gen)
    phase = torch.rand(vocab_size, dtype=torch.float64, generator=gen) * (2 * math.pi)
    return base, phase


def token_logprobs(token_ids: torch.Tensor, version: int, *, policy_seed: int, vocab_size: int) -> torch.Tensor:
    """float32 log-probs (all < 0) of ``token_ids`` under policy ``version``.

    Each optimizer step moves every token's log-prob a little (a few percent),
    so a train step visibly changes log-probs and off-policy tokens differ
    from on-policy ones by an amount that grows with the version gap.
    """
    base, phase = _token_table(policy_seed, vocab_size)
    ids = token_ids.to(torch.int64) % vocab_size
    drift = 0.05 * torch.sin(phase[ids] + 0.7 * version)
    return (base[ids] * (1.0 + drift) - 1e-4).to(torch.float32)


@lru_cache(maxsize=4)
def token_buffer(policy_seed: int, vocab_size: int) -> torch.Tensor:
    """The int64 buffer of token ids that results slice, one per simulated policy (engine seeds pick the offsets).

    Cached and shared: treat it (and slices of it) as read-only.
    """
    gen = torch.Generator().manual_seed(policy_seed + 0x5EED)
    return torch.randint(0, vocab_size, (BUFFER_TOKENS,), generator=gen, dtype=torch.int64)


@lru_cache(maxsize=32)
def logprob_buffer(policy_seed: int, vocab_size: int, version: int) -> torch.Tensor:
    """float32 log-probs aligned with :func:`token_buffer` under ``version`` (cached for the recent versions; read-only)."""
    ids = token_buffer(policy_seed, vocab_size)
    return token_logprobs(ids, version, policy_seed=policy_seed, vocab_size=vocab_size)


def cyclic_slice(buffer: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """``length`` items of 1-D ``buffer`` from ``start``, wrapping around.

    A view of ``buffer`` in the usual case (no wrap), else a new tensor made
    with one ``torch.cat``; either way no per-item Python work.
    """
    n = buffer.shape[0]
    start %= n
    end = start + length
    if end <= n:
        return buffer[start:end]
    parts = [buffer[start:]]
    remaining = length - (n - start)
    full, rest = divmod(remaining, n)
    parts.extend([buffer] * full)
    if rest:
        parts.append(buffer[:rest])
    return torch.cat(parts)
