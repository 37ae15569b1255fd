"""StalenessGuard on its own: what a replica may start and which generations are unusable, as the trainer moves.

The run is a plain namespace with ``version`` and ``k`` (no runtime, store or engine).
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.staleness import StalenessGuard


def test_a_replica_may_start_while_its_weights_are_inside_the_bound_and_the_guard_follows_the_trainer():
    run = SimpleNamespace(version=3, k=1)
    guard = StalenessGuard(run)
    assert guard.may_start(2) and guard.may_start(3) and not guard.may_start(1)
    run.version = 4
    assert not guard.may_start(2) and guard.may_start(3)
    run.k = 0
    assert not guard.may_start(3) and guard.may_start(4)


def test_a_generation_is_unusable_once_its_oldest_token_is_outside_the_bound():
    run = SimpleNamespace(version=5, k=2)
    guard = StalenessGuard(run)
    assert guard.unusable(2) and not guard.unusable(3)
    assert not guard.unusable(None)  # no tokens yet: nothing stale


def test_start_version_is_the_oldest_of_the_engine_and_the_resumed_prefix():
    assert StalenessGuard.start_version(4) == 4
    assert StalenessGuard.start_version(4, (3, 3, 4)) == 3
    assert StalenessGuard.start_version(4, (5,)) == 4


def test_to_abort_picks_the_in_flight_requests_that_started_too_long_ago():
    run = SimpleNamespace(version=2, k=1)
    guard = StalenessGuard(run)
    inflight = {f"r{v}": SimpleNamespace(start_version=v) for v in range(4)}
    assert guard.to_abort(inflight) == ["r0"]
    assert guard.to_abort(inflight, version=3) == ["r0", "r1"]
    run.version = 4
    assert guard.to_abort(inflight) == ["r0", "r1", "r2"]
    assert guard.to_abort({}) == []


@given(v=st.integers(0, 50), k=st.integers(0, 5), ev=st.integers(0, 50))
def test_the_guard_agrees_with_the_rule(v, k, ev):
    guard = StalenessGuard(SimpleNamespace(version=v, k=k))
    assert guard.may_start(ev) == S.engine_may_start(ev, v, k)
    assert guard.unusable(ev) == S.must_abort(ev, v, k)
    # a request a replica may start now is not aborted at once
    if guard.may_start(ev):
        assert not guard.to_abort({"q": SimpleNamespace(start_version=ev)})


@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=4), min_size=1, max_size=4), st.integers(0, 9),
       st.integers(0, 12), st.integers(0, 3))
def test_an_episode_turn_is_as_old_as_the_oldest_token_of_every_turn_before_it(turns, engine_v, trainer_v, k):
    """A multi-turn episode's next request starts no newer than its oldest sampled token (earlier turns included),
    so the in-flight abort and the result check see the whole episode; single-turn rows are unchanged."""
    from asyncflow_core.flow.episode import MultiTurn
    from asyncflow_core.types import FinishReason, GenerationResult

    ep = MultiTurn(0, None, (1,), 0)
    for t, versions in enumerate(turns):
        ep.take_turn(GenerationResult(f"t{t}", (1,), [2] * len(versions), [0.0] * len(versions), versions,
                                      FinishReason.STOP))
    oldest = min(v for vs in turns for v in vs)
    run = SimpleNamespace(version=trainer_v, k=k)
    guard = StalenessGuard(run)
    start = guard.start_version(engine_v, ep.held_versions())
    assert start == min(engine_v, oldest)
    assert guard.to_abort({"r": SimpleNamespace(start_version=start)}) == (["r"] if trainer_v - start > k else [])
    assert guard.unusable(ep.oldest_version()) == (trainer_v - oldest > k)
    fresh = GenerationResult("n", (1,), [3], [0.0], [engine_v], FinishReason.STOP)
    assert ep.oldest_with(fresh) == min(oldest, engine_v)
