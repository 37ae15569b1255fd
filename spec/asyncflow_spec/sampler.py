"""Conformance tests for Sampler backends.

A sampler runs on the store's hot path and decides which ready rows a
consumer gets. Its contract (``asyncflow_core.interfaces.sampler``), and the
two things a sampler may declare that let the runtime skip work:

- ``takes_oldest``: a single-rank pick is the oldest candidates. The store
  then leases the oldest rows itself and never calls ``sample``; a sampler
  that declares it and picks otherwise would be silently bypassed.
- ``whole_group_size(store_group_size)``: the sampler hands out whole prompt
  groups only. The store wakes its waiters only when a group may have
  completed, and the train stage then computes group-scoped advantages in its
  own lease (``pipeline.fold_advantages``); a sampler that declares it and
  hands out part of a group would get advantages computed over half a group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncflow_core.interfaces.sampler import Candidates, Sampler, SampleRequest
from asyncflow_core.plugins import PluginKind
from asyncflow_spec.base import BackendSpec

#: rows per group of the candidates the suite builds (and the store's ``group_size`` they claim)
GROUP_SIZE = 4


def make_candidates(seed: int, groups: int = 12, group_size: int = GROUP_SIZE) -> Candidates:
    """Ready rows of ``groups`` prompt groups in arrival order: each group has 1..``group_size`` of its rows here
    (so some are complete and some are not), interleaved with the others as a streaming rollout writes them."""
    gen = torch.Generator().manual_seed(seed)
    present = torch.randint(1, group_size + 1, (groups,), generator=gen)
    present[torch.randperm(groups, generator=gen)[: max(1, groups // 3)]] = group_size  # some complete ones
    gids = torch.repeat_interleave(torch.arange(groups), present)
    gids = gids[torch.randperm(gids.numel(), generator=gen)]
    n = gids.numel()
    ready = torch.bincount(gids, minlength=groups)[gids]
    return Candidates(
        row_ids=torch.arange(100, 100 + n, dtype=torch.int64),
        group_ids=gids.to(torch.int64),
        num_tokens=torch.randint(1, 64, (n,), generator=gen),
        min_version=torch.randint(-1, 4, (n,), generator=gen),
        group_ready=ready.to(torch.int64),
        group_size=group_size,
    )


def requests(sampler: Sampler, cands: Candidates) -> list[SampleRequest]:
    """Single-rank requests around the number of candidates, with and without ``partial``; batch sizes are whole
    groups for a sampler that hands out whole groups (it may refuse any other)."""
    unit = _whole(sampler, cands) or 1
    sizes = sorted({unit, 2 * unit, 3 * unit, len(cands) // unit * unit or unit, (len(cands) // unit + 2) * unit})
    return [SampleRequest(batch_size=b, partial=p) for b in sizes for p in (False, True)]


def _whole(sampler: Sampler, cands: Candidates) -> int:
    size = getattr(sampler, "whole_group_size", None)
    return int(size(cands.group_size)) if callable(size) else 0


class SamplerSpec(BackendSpec):
    """Subclass and set ``backend``/``options`` (the sampler's registered name and its config)."""

    kind = PluginKind.SAMPLER
    seeds = range(8)

    def _pick(self, sampler: Sampler, cands: Candidates, req: SampleRequest) -> torch.Tensor:
        pick = sampler.sample(cands, req)
        assert isinstance(pick, torch.Tensor) and pick.dtype == torch.int64 and pick.dim() == 1, (
            f"sample() must return a 1-D int64 tensor of positions, got {pick!r}")
        return pick

    def test_a_pick_is_distinct_positions_within_the_batch_size(self, make_backend):
        """Positions inside the candidates, no duplicates, never more than ``batch_size``, and fewer (but not
        none) only when the request is ``partial``."""
        sampler: Sampler = make_backend()
        for seed in self.seeds:
            cands = make_candidates(seed)
            for req in requests(sampler, cands):
                pick = self._pick(sampler, cands, req)
                where = f"(seed {seed}, batch_size {req.batch_size}, partial {req.partial}, {len(cands)} candidates)"
                assert bool(((pick >= 0) & (pick < len(cands))).all()), f"positions outside the candidates {where}"
                assert pick.unique().numel() == pick.numel(), f"duplicate positions {where}"
                assert pick.numel() <= req.batch_size, f"{pick.numel()} rows for batch_size {req.batch_size} {where}"
                if not req.partial:
                    assert pick.numel() in (0, req.batch_size), (
                        f"{pick.numel()} rows without partial: a pick is a full batch or empty {where}")

    def test_a_pick_is_a_function_of_its_inputs(self, make_backend):
        """Two fresh samplers given the same requests pick the same rows (a replayed run makes the same choices)."""
        first: Sampler = make_backend()
        second: Sampler = make_backend()
        for seed in self.seeds:
            cands = make_candidates(seed)
            for req in requests(first, cands):
                a, b = self._pick(first, cands, req), self._pick(second, cands, req)
                assert torch.equal(a, b), f"seed {seed}, {req}: {a.tolist()} then {b.tolist()}"

    def test_data_parallel_parts_are_disjoint(self, make_backend):
        """Each rank's part of one pick is its own: the parts for ``dp_size`` ranks on the same candidates share
        no row (the store leases all parts at once)."""
        sampler: Sampler = make_backend()
        for seed in self.seeds:
            cands = make_candidates(seed)
            unit = _whole(sampler, cands) or 1
            for dp in (2, 3):
                batch = dp * unit * 2
                parts = [self._pick(sampler, cands, SampleRequest(batch, partial=True, dp_rank=r, dp_size=dp))
                         for r in range(dp)]
                joined = torch.cat(parts)
                assert joined.unique().numel() == joined.numel(), (
                    f"seed {seed}, dp_size {dp}: ranks' parts overlap: {[p.tolist() for p in parts]}")
                assert joined.numel() <= batch

    def test_takes_oldest_is_what_it_picks(self, make_backend):
        """A sampler that declares ``takes_oldest`` picks positions ``0 .. k - 1`` with ``k = min(candidates,
        batch_size)`` (none without ``partial`` when short): the store skips ``sample`` on that declaration."""
        sampler: Sampler = make_backend()
        if not getattr(sampler, "takes_oldest", False):
            pytest.skip(f"{type(sampler).__name__} does not declare takes_oldest")
        for seed in self.seeds:
            cands = make_candidates(seed)
            for req in requests(sampler, cands):
                k = min(len(cands), req.batch_size)
                if k < req.batch_size and not req.partial:
                    k = 0
                pick = self._pick(sampler, cands, req)
                assert torch.equal(pick, torch.arange(k)), (
                    f"{type(sampler).__name__} declares takes_oldest but picked {pick.tolist()} for {req} over "
                    f"{len(cands)} candidates (the oldest would be 0..{k - 1}); the store never calls sample() for "
                    "it, so its real pick would be ignored: remove the declaration (Sampler.takes_oldest)")

    def test_whole_group_size_hands_out_whole_groups(self, make_backend):
        """A sampler with ``whole_group_size`` hands out every group it picks whole (all ``whole_group_size`` rows
        of it) and no row without a group: the store's wake-ups and the train stage's folded advantages rely on
        it."""
        sampler: Sampler = make_backend()
        if not callable(getattr(sampler, "whole_group_size", None)):
            pytest.skip(f"{type(sampler).__name__} does not define whole_group_size")
        for seed in self.seeds:
            cands = make_candidates(seed)
            gs = _whole(sampler, cands)
            assert gs > 0, f"whole_group_size({cands.group_size}) is {gs}: a known group size must give one"
            for req in requests(sampler, cands):
                pick = self._pick(sampler, cands, req)
                gids = cands.group_ids[pick]
                assert bool((gids >= 0).all()), f"{req}: rows without a group handed out"
                counts: dict[Any, int] = {}
                for g in gids.tolist():
                    counts[g] = counts.get(g, 0) + 1
                part = {g: c for g, c in counts.items() if c != gs}
                assert not part, (
                    f"{type(sampler).__name__} defines whole_group_size ({gs}) but handed out part of groups "
                    f"{sorted(part)} ({part}) for {req}; advantages would be computed over part of a group")
