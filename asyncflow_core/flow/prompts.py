"""Prompt ids of a leased batch as the tuples the rollout stage's episodes carry."""

from __future__ import annotations

import math

from asyncflow_core.types import RaggedTensor

__all__ = ["row_prompts"]


def row_prompts(prompts: RaggedTensor, gids: list[int]) -> list[tuple[int, ...]]:
    """Each row's prompt ids as a tuple. The rows of a group usually carry one prompt: a row whose ids equal
    those of its group's first row in the lease gets that row's tuple; any other row is converted.

    The comparison is of the rows' bytes, sliced from one copy of the values: no tensor call per row (each
    costs a few µs of the driver's GIL, ~10 µs a row for the two slices and ``torch.equal`` it replaced), and
    no conversion of a repeated row's ids to Python ints.
    """
    offs = prompts.offsets.tolist()
    vals = prompts.values
    arr = (vals if vals.device.type == "cpu" else vals.cpu()).detach().numpy()
    raw = arr.tobytes()
    width = arr.itemsize * math.prod(arr.shape[1:])  #: bytes per token (0 for lengths-only values)
    first: dict[int, int] = {}
    out: list[tuple[int, ...]] = []
    for i, g in enumerate(gids):
        a, b = offs[i], offs[i + 1]
        j = first.setdefault(g, i)
        c, d = offs[j], offs[j + 1]
        if j != i and d - c == b - a and raw[a * width:b * width] == raw[c * width:d * width]:
            out.append(out[j])
        else:
            out.append(tuple(arr[a:b].tolist()))
    return out
