"""Prompt ids of a leased batch as the tuples the rollout stage's episodes carry."""

from __future__ import annotations

import torch

from asyncflow_core.types import RaggedTensor

__all__ = ["row_prompts"]


def row_prompts(prompts: RaggedTensor, gids: list[int]) -> list[tuple[int, ...]]:
    """Each row's prompt ids as a tuple. The rows of a group usually carry one prompt: a row whose ids equal
    those of its group's first row in the lease gets that row's tuple (one comparison in C instead of a
    conversion of every id to a Python int, ~4x cheaper for a 512-token prompt); any other row is converted."""
    offs = prompts.offsets.tolist()
    vals = prompts.values
    first: dict[int, int] = {}
    out: list[tuple[int, ...]] = []
    for i, g in enumerate(gids):
        a, b = offs[i], offs[i + 1]
        j = first.setdefault(g, i)
        if j != i and offs[j + 1] - offs[j] == b - a and torch.equal(vals[a:b], vals[offs[j]:offs[j + 1]]):
            out.append(out[j])
        else:
            out.append(tuple(vals[a:b].tolist()))
    return out
