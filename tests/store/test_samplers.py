"""Built-in samplers: FIFO, group-complete, token-balanced (Karmarkar–Karp), similar-length."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.interfaces import Candidates, SampleRequest
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.store.errors import InvalidRequestError
from asyncflow_plugins.samplers import GroupSampler, GroupSamplerConfig, TokenBalancedSampler, karmarkar_karp


def cands(tokens, groups=None, group_size=0) -> Candidates:
    n = len(tokens)
    g = torch.tensor(groups if groups is not None else [-1] * n, dtype=torch.int64)
    ready = torch.tensor([sum(1 for y in g.tolist() if y == x) if x >= 0 else 0 for x in g.tolist()])
    return Candidates(torch.arange(100, 100 + n), g, torch.tensor(tokens, dtype=torch.int64),
                      torch.zeros(n, dtype=torch.int64), ready, group_size)


def test_registered_by_name():
    pm = get_plugin_manager()
    assert {"fifo", "group", "token_balanced", "similar_length"} <= set(pm.registrations("sampler"))
    assert isinstance(pm.create("sampler", "group", {"group_size": 4}), GroupSampler)


def test_fifo_full_partial_and_dp_chunks():
    fifo = get_plugin_manager().create("sampler", "fifo")
    c = cands([1] * 5)
    assert fifo.sample(c, SampleRequest(3)).tolist() == [0, 1, 2]
    assert fifo.sample(c, SampleRequest(8)).numel() == 0
    assert fifo.sample(c, SampleRequest(8, partial=True)).tolist() == [0, 1, 2, 3, 4]
    parts = [fifo.sample(c, SampleRequest(4, dp_rank=r, dp_size=2)).tolist() for r in range(2)]
    assert parts == [[0, 1], [2, 3]]


def test_group_sampler_hands_out_whole_groups_oldest_first():
    smp = GroupSampler(GroupSamplerConfig(group_size=2))
    c = cands([1] * 7, groups=[5, 3, 5, 9, 3, 7, -1])  # group 9 and 7 incomplete
    assert smp.sample(c, SampleRequest(4)).tolist() == [0, 2, 1, 4]
    assert smp.sample(c, SampleRequest(6)).numel() == 0
    assert smp.sample(c, SampleRequest(6, partial=True)).tolist() == [0, 2, 1, 4]
    assert smp.sample(c, SampleRequest(4, dp_rank=1, dp_size=2)).tolist() == [1, 4]
    with pytest.raises(InvalidRequestError):
        smp.sample(c, SampleRequest(3))
    with pytest.raises(InvalidRequestError):
        GroupSampler().sample(c, SampleRequest(2))  # no group size anywhere


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=30), st.integers(1, 4), st.integers(1, 3))
def test_group_sampler_never_splits_a_group(groups, gs, k):
    c = cands([1] * len(groups), groups=groups, group_size=gs)
    pos = GroupSampler().sample(c, SampleRequest(gs * k, partial=True))
    chosen = c.group_ids[pos].tolist()
    assert all(chosen.count(g) == gs for g in set(chosen)) and -1 not in chosen
    assert len(pos) <= gs * k


def _spread(weights, parts):
    sums = [sum(weights[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def _optimum(weights, k):
    best = None
    for assign in itertools.product(range(k), repeat=len(weights)):
        parts = [[i for i, a in enumerate(assign) if a == j] for j in range(k)]
        best = _spread(weights, parts) if best is None else min(best, _spread(weights, parts))
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=2, max_size=8), st.integers(2, 3))
def test_karmarkar_karp_near_brute_force_optimum(weights, k):
    parts = karmarkar_karp(weights, k, equal_size=False)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    spread, best = _spread(weights, parts), _optimum(weights, k)
    assert best <= spread <= best + max(weights)  # the differencing bound


def test_karmarkar_karp_known_cases_and_equal_size():
    assert _spread([8, 7, 6, 5, 4], karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)) == 2
    assert _spread([4, 5, 6, 7, 8], karmarkar_karp([4, 5, 6, 7, 8], 2, equal_size=False)) == 2
    w = [1, 2, 3, 4, 5, 6, 7, 8]
    parts = karmarkar_karp(w, 2)
    assert [len(p) for p in parts] == [4, 4] and _spread(w, parts) == 0


def test_token_balanced_dp_parts_are_disjoint_balanced_and_deterministic():
    tokens = [100, 3, 50, 50, 7, 90, 1, 60]
    c = cands(tokens)
    smp = TokenBalancedSampler()
    parts = [smp.sample(c, SampleRequest(8, dp_rank=r, dp_size=2)).tolist() for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(8))
    sums = [sum(tokens[i] for i in p) for p in parts]
    assert abs(sums[0] - sums[1]) < abs(sum(tokens[:4]) - sum(tokens[4:]))  # better than a contiguous split
    fresh = [TokenBalancedSampler().sample(cands(tokens), SampleRequest(8, dp_rank=r, dp_size=2)).tolist()
             for r in range(2)]
    assert fresh == parts


def test_similar_length_groups_lengths_near_the_oldest():
    smp = get_plugin_manager().create("sampler", "similar_length")
    c = cands([50, 5, 900, 48, 52, 7, 1000])
    assert smp.sample(c, SampleRequest(3)).tolist() == [0, 3, 4]
    parts = [smp.sample(c, SampleRequest(4, dp_rank=r, dp_size=2)).tolist() for r in range(2)]
    assert sorted(parts[0] + parts[1]) == [0, 1, 3, 4] or sorted(parts[0] + parts[1]) == [0, 3, 4, 5]
