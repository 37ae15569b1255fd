"""The admission formula and the staleness rule, as pure functions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_core.flow import staleness as S


def test_admission_limit_is_k_plus_v_plus_one_steps_of_prompts():
    assert S.admission_limit(0, 0, 8) == 8  # sync: one step's prompts before the first update
    assert S.admission_limit(0, 1, 8) == 16  # one_step: the next step's prompts start early
    assert S.admission_limit(3, 2, 5) == 30
    with pytest.raises(ValueError):
        S.admission_limit(0, -1, 8)
    with pytest.raises(ValueError):
        S.admission_limit(0, 0, 0)


@given(v=st.integers(0, 1000), k=st.integers(0, 8), minv=st.integers(0, 1000))
def test_the_rule_and_its_helpers_agree(v, k, minv):
    fresh = S.is_fresh(v, minv, k)
    assert fresh == (v - minv <= k)
    assert S.must_abort(minv, v, k) == (minv < S.oldest_usable(v, k))
    # a row that may be used now is never aborted now, and vice versa (for rows not from the future)
    if minv <= v:
        assert fresh != S.must_abort(minv, v, k)
    assert S.engine_may_start(minv, v, k) == (not S.must_abort(minv, v, k))


@given(
    v=st.integers(0, 50), k=st.integers(0, 4),
    rows=st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 50)), min_size=1, max_size=40),
)
def test_groups_are_fresh_or_stale_as_a_whole(v, k, rows):
    gids = torch.tensor([g for g, _ in rows])
    minv = torch.tensor([m for _, m in rows])
    fresh, stale = S.split_fresh_groups(v, k, gids, minv)
    assert bool((fresh ^ stale).all())  # a partition
    assert bool(((v - minv[fresh]) <= k).all())  # no fresh row breaks the bound
    for g in set(gids.tolist()) - {-1}:
        members = gids == g
        assert bool(fresh[members].all()) or bool(stale[members].all())
    ungrouped = gids < 0
    assert bool((stale[ungrouped] == ((v - minv[ungrouped]) > k)).all())
