"""Which rows go to which rank, and which rows share a micro-batch. Pure functions on row lengths.

Every rank of a rank-group train engine must run the same number of
forward/backward passes (FSDP's all-gathers and reduce-scatters, Megatron's
gradient reduction are collectives), so the plan is made once, in the driver
(:mod:`asyncflow_core.launchers.rank_driver`), for all ranks; a rank with
fewer micro-batches than the busiest one runs empty passes
(:data:`asyncflow_core.launchers.rank_worker.EMPTY_PASS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def split_across_ranks(lengths: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Rows per rank, balanced by tokens: longest row first, each to the rank with the fewest tokens so far.

    Returns ``world_size`` sorted int64 index tensors that partition ``range(len(lengths))``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:  # every row to the one rank (what the loop below gives, without a Python step per row)
        return [torch.arange(len(lengths), dtype=torch.int64)]
    load = [0] * world_size
    rows: list[list[int]] = [[] for _ in range(world_size)]
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], len(rows[k]), k))
        rows[r].append(i)
        load[r] += int(lengths[i])
    return [torch.tensor(sorted(r), dtype=torch.int64) for r in rows]


def micro_batches(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Rows grouped so that ``rows x longest row <= budget`` (the padded size of one forward).

    Rows are taken longest first, so rows of similar length share a micro-batch
    and padding stays small; a row longer than ``budget`` gets a micro-batch
    of its own. Returns index tensors into ``lengths``.
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    order = torch.argsort(lengths, descending=True, stable=True)
    ordered = lengths[order].tolist()
    out: list[torch.Tensor] = []
    start = 0
    while start < len(ordered):
        # the first row of a micro-batch is its longest (descending order): it fixes how many rows fit,
        # one step per micro-batch rather than per row
        longest = int(ordered[start])
        take = len(ordered) - start if longest == 0 else max(1, budget // longest)
        out.append(order[start:start + take].clone())
        start += take
    return out


@dataclass(frozen=True)
class StepPlan:
    """The rows of every rank and each rank's micro-batches (indices into that rank's rows)."""

    rank_rows: list[torch.Tensor]
    rank_micro_batches: list[list[torch.Tensor]]

    @property
    def passes(self) -> int:
        """Forward (and backward) passes every rank runs: the busiest rank's micro-batch count, at least 1."""
        return max(1, *(len(m) for m in self.rank_micro_batches))


def plan_step(lengths: torch.Tensor, world_size: int, budget: int) -> StepPlan:
    """Split rows over ranks, then each rank's rows into micro-batches."""
    rank_rows = split_across_ranks(lengths, world_size)
    return StepPlan(rank_rows, [micro_batches(lengths[rows], budget) for rows in rank_rows])


__all__ = ["StepPlan", "micro_batches", "plan_step", "split_across_ranks"]
