"""The sampler spec fails samplers whose declarations do not hold (each would break a run without an error)."""

from __future__ import annotations

import pytest
import torch

from asyncflow_core.interfaces.sampler import Candidates, SampleRequest
from asyncflow_plugins.samplers import FifoSampler, GroupSampler
from asyncflow_spec import SamplerSpec


_NONE = torch.empty(0, dtype=torch.int64)


def _short(n: int, request: SampleRequest) -> bool:
    """No candidate, or fewer than a full batch without ``partial``: the contract's empty pick."""
    return n == 0 or (n < request.batch_size and not request.partial)


class NewestButDeclaresOldest(FifoSampler):
    """Picks the newest rows while still declaring ``takes_oldest``: the store would lease the oldest instead."""

    takes_oldest = True

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        n = len(candidates)
        return _NONE if _short(n, request) else torch.arange(max(0, n - request.batch_size), n)


class HalfGroups(GroupSampler):
    """Declares whole groups but hands out the first half of each (folded advantages over half a group)."""

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        pick = super().sample(candidates, request)
        return pick[: max(1, pick.numel() // 2)] if pick.numel() else pick


class Overfull(FifoSampler):
    """Hands out one row more than asked."""

    takes_oldest = False

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        return torch.arange(min(len(candidates), request.batch_size + 1))


class Seeded(FifoSampler):
    """Picks at random from a fresh, unseeded generator: a replay would lease other rows."""

    takes_oldest = False

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        n = len(candidates)
        return _NONE if _short(n, request) else torch.randperm(n)[: request.batch_size].sort().values


def _spec_test(name: str):
    return getattr(SamplerSpec, name)


@pytest.mark.parametrize(("mutant", "test", "message"), [
    (NewestButDeclaresOldest, "test_takes_oldest_is_what_it_picks", "declares takes_oldest but picked"),
    (HalfGroups, "test_whole_group_size_hands_out_whole_groups", "handed out part of groups"),
    (Overfull, "test_a_pick_is_distinct_positions_within_the_batch_size", "rows for batch_size"),
    (Seeded, "test_a_pick_is_a_function_of_its_inputs", "then"),
])
def test_the_sampler_spec_fails_the_mutant(mutant, test, message):
    with pytest.raises(AssertionError, match=message):
        _spec_test(test)(SamplerSpec(), mutant)


@pytest.mark.parametrize("sampler", [FifoSampler, GroupSampler])
@pytest.mark.parametrize("test", [t for t in dir(SamplerSpec) if t.startswith("test_")])
def test_the_unmutated_samplers_pass_every_check(sampler, test):
    _spec_test(test)(SamplerSpec(), sampler)


def test_an_override_without_a_declaration_loses_takes_oldest():
    """A subclass of a declaring sampler that brings its own ``sample`` is not trusted with the parent's claim."""

    class Own(FifoSampler):
        def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
            return super().sample(candidates, request)

    assert FifoSampler.takes_oldest and not Own.takes_oldest
