"""Episode recovery: lost environments rebuilt by replay (or restarted), replay checked, stale turns re-based,
``staleness_basis: request_start`` across turns, and tool-error reasons counted.

The worker-process tests kill a real environment worker (``os._exit`` on demand, tests/envs/env_fixtures.py)
in the middle of four episodes living in it, and read the rows back from the store.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from asyncflow_core import columns as C
from asyncflow_core.flow.env_pool import EnvironmentPool
from asyncflow_core.flow.episode import EpisodeSettings, MultiTurn, MultiTurnEpisodes
from asyncflow_core.flow.episode_recovery import MAX_REASON_KEYS, OTHER_REASONS, merge_events, step_reason
from asyncflow_core.flow.render import Renderer
from asyncflow_core.flow.staleness import REQUEST_START, TailPolicy
from asyncflow_core.flow.tokenizer import CharTokenizer
from asyncflow_core.interfaces.environment import Environment, EnvironmentFeatures, Observation, Step
from asyncflow_core.types import FinishReason, GenerationResult, PromptRecord
from tests.envs.env_fixtures import make_replayable, make_reset_only
from tests.flow.test_episode import STOP, TOK, FakeEngine, _rows, _run, ep_settings, failed


def _pool_records(folder: Path, n: int = 4, turns: int = 4, diverge: tuple[int, ...] = ()) -> list[PromptRecord]:
    """Row 0 kills the worker at its step 1 (once); the rows in ``diverge`` answer differently once rebuilt."""
    (folder / "flag").touch()
    recs = []
    for i in range(n):
        meta = {"turns": turns, "dir": str(folder), **({"exit_at": 1, "others": n - 1} if i == 0 else {}),
                **({"diverge": True} if i in diverge else {})}
        recs.append(PromptRecord(i, f"q{i} ", metadata=meta))
    return recs


def _through_a_worker(recs, factory, **kw):
    """Four episodes in one worker process (the pool's): returns what ``_run`` does."""
    engine = FakeEngine(seed=11)

    async def main():
        pool = EnvironmentPool(factory, step_timeout_s=30.0, workers=8, processes=1)
        try:
            eps = MultiTurnEpisodes(ep_settings(pool.open, step_timeout_s=30.0, **kw))
            return await _run(recs, eps, engines=[engine], max_new=4)
        finally:
            await pool.close()

    return asyncio.run(main()), engine


def test_a_killed_worker_is_rebuilt_by_replay_and_a_replay_that_differs_fails_with_its_reason(tmp_path):
    """Row 0's step kills the worker process while the three other episodes wait in it: all four environments
    are rebuilt in a new worker by reset + the recorded actions. Rows 0 and 1 answer as recorded (checked): the
    lost step runs again and each goes on with its turns, every turn's request the exact tokens before it.
    Rows 2 and 3 answer differently once rebuilt: each fails with that reason (written once as a placeholder),
    never goes on diverged."""
    (batch, order, ctx, at_write, _), engine = _through_a_worker(_pool_records(tmp_path, diverge=(2, 3)),
                                                                 make_replayable)
    rows = _rows(batch, order)
    assert sorted(rows) == [0, 1, 2, 3] and sorted(at_write) == [0, 1, 2, 3]
    assert not (tmp_path / "flag").exists()  # the worker really exited
    assert ctx.counters["env_lost"] == 4 and ctx.counters["env_replayed"] == 4, ctx.counters
    assert ctx.counters["replay_mismatch"] == 2 and ctx.counters["episodes_done"] == 2, ctx.counters
    reasons = failed(ctx)
    assert sorted(reasons) == [2, 3], reasons
    for row, why in reasons.items():
        assert "environment replay diverged at step 0: the observation renders to 6 tokens, recorded 5" in why, why
        assert rows[row][C.RESPONSE_IDS] == []
    for row in (0, 1):
        r = rows[row]
        assert r[C.TURN_REWARDS] == pytest.approx([0.5, 1.5, 2.5, 3.5]) and r[C.REWARD] == pytest.approx(8.0)
        ids, mask = r[C.RESPONSE_IDS], r[C.LOSS_MASK]
        assert TOK.decode([t for t, m in zip(ids, mask) if not m]) == " ok0: ok1: ok2:"
        prompt = batch[C.PROMPT_IDS][order.index(row)].tolist()
        starts = [i for i, (m, prev) in enumerate(zip(mask, [False] + mask)) if m and not prev]
        assert len(starts) == 4
        for t, s in enumerate(starts):  # no restart: the same attempt's requests, one per turn
            rid = f"row{row}-try0-turn{t}"
            res = engine.returned[rid]
            assert list(engine.prompts[rid]) == prompt + ids[:s]
            assert ids[s:s + len(res.token_ids)] == list(res.token_ids)
    replays = [s for s in ctx.timeline.spans if s.name == "replay"]
    assert len(replays) >= 4 and all(s.lane.startswith("env/") for s in replays)


def test_a_lost_worker_restarts_episodes_of_an_environment_that_declares_reset(tmp_path):
    """``restore: reset``: the four episodes of the killed worker start again from reset (their sampled turns
    thrown away, a new attempt), and each is written once, complete."""
    (batch, order, ctx, at_write, _), engine = _through_a_worker(_pool_records(tmp_path), make_reset_only)
    rows = _rows(batch, order)
    assert sorted(rows) == [0, 1, 2, 3] and sorted(at_write) == [0, 1, 2, 3] and not failed(ctx)
    assert ctx.counters["restarted_env_lost"] == 4 and ctx.counters["env_replayed"] == 0, ctx.counters
    for row, r in rows.items():
        assert r[C.EPISODE_TURNS] == 4 and f"row{row}-try1-turn3" in engine.returned  # the restart's attempt


def test_a_step_that_times_out_fails_alone_and_the_others_in_its_restarted_worker_are_replayed(tmp_path):
    """Row 0's step holds its worker process past the pool's time-out: that episode fails with its time-out, the
    worker is restarted, and the three other episodes that lived there (lost through no call of their own) are
    rebuilt by replay and written complete."""
    roles = [{"block_at": 0, "others": 3}] + [{"hold": True, "hold_s": 0.8}] * 3
    recs = [PromptRecord(i, f"q{i} ", metadata={"turns": 4, "dir": str(tmp_path), "bound_s": 30, **roles[i]})
            for i in range(4)]
    engine = FakeEngine(seed=11)

    async def main():
        pool = EnvironmentPool(make_replayable, step_timeout_s=2.0, workers=8, processes=1)
        try:  # the episode's own limit above the pool's: the pool times the call out and restarts the worker
            eps = MultiTurnEpisodes(ep_settings(pool.open, step_timeout_s=30.0))
            return await _run(recs, eps, engines=[engine], max_new=4)
        finally:
            await pool.close()

    batch, order, ctx, at_write, _ = asyncio.run(main())
    assert sorted(at_write) == [0, 1, 2, 3]
    reasons = failed(ctx)
    assert list(reasons) == [0] and "step (turn 0) timed out after 2s" in reasons[0] and \
        "its worker process was restarted" in reasons[0], reasons
    assert ctx.counters["env_replayed"] == 3 and ctx.counters["episodes_done"] == 3, ctx.counters
    assert all(r[C.EPISODE_TURNS] == 4 for row, r in _rows(batch, order).items() if row != 0)


def test_with_no_rebuild_left_the_worker_exit_is_each_episodes_recorded_reason(tmp_path):
    """``max_env_rebuilds=0``: every episode of the killed worker fails with the worker's reason, recorded;
    none is lost, none written twice."""
    (batch, order, ctx, at_write, _), _ = _through_a_worker(_pool_records(tmp_path), make_replayable,
                                                            max_env_rebuilds=0)
    assert sorted(at_write) == [0, 1, 2, 3]
    reasons = failed(ctx)
    assert sorted(reasons) == [0, 1, 2, 3], reasons
    for why in reasons.values():
        assert "its worker process exited" in why and "max_env_rebuilds=0" in why, why


# -- in the event loop: a lost environment simulated (the pool's ``lost``), replay and stale turns -------------


class Flaky(Environment):
    """Observations from the record; ``lose_at``: that step loses the environment once per episode (as a dead
    worker does); ``shift``: environments built after a loss answer differently (a replay cannot match)."""

    built = 0
    lost_rows: set = set()
    steps: list = []

    def __init__(self, restore: str = "replay") -> None:
        type(self).built += 1
        self.generation = type(self).built
        self._features = EnvironmentFeatures(owns_reward=True, restore=restore)
        self.lost = None

    @property
    def features(self):
        return self._features

    async def reset(self, record, *, seed):
        self.record = record
        return Observation(text=record["prompt"])

    async def step(self, action):
        rec = self.record
        type(self).steps.append((rec["index"], action.turn, action.token_ids, action.text))
        if rec.get("lose_at") == action.turn and rec["index"] not in type(self).lost_rows:
            type(self).lost_rows.add(rec["index"])
            self.lost = "its worker process exited"
            raise RuntimeError("the pipe broke")
        shifted = "a" if rec.get("shift") and rec["index"] in type(self).lost_rows else ""
        done = action.turn + 1 >= rec["turns"]
        return Step(None if done else Observation(text=f" ok{action.turn}:{shifted}"), reward=0.5 + action.turn,
                    done=done)


def _flaky(n, **meta):
    Flaky.built, Flaky.lost_rows, Flaky.steps = 0, set(), []
    return [PromptRecord(i, f"q{i} ", metadata={"turns": 3, **meta}) for i in range(n)]


def _same_as_the_engine(batch, order, engine, turns: int, attempt: int = 0) -> None:
    """Every row: each turn's request was exactly the tokens before it, and the row holds what the engine returned."""
    for row, r in _rows(batch, order).items():
        ids, mask = r[C.RESPONSE_IDS], r[C.LOSS_MASK]
        prompt = batch[C.PROMPT_IDS][order.index(row)].tolist()
        starts = [i for i, (m, prev) in enumerate(zip(mask, [False] + mask)) if m and not prev]
        assert len(starts) == turns == r[C.EPISODE_TURNS]
        for t, s in enumerate(starts):
            rid = f"row{row}-try{attempt}-turn{t}"
            assert list(engine.prompts[rid]) == prompt + ids[:s]
            assert ids[s:s + len(engine.returned[rid].token_ids)] == list(engine.returned[rid].token_ids)


@pytest.mark.parametrize("lose_at", [0, 1, 2])
def test_in_loop_a_lost_environment_is_replayed_and_the_same_actions_are_stepped_again(lose_at):
    recs = _flaky(3, lose_at=lose_at)
    engine = FakeEngine()
    batch, order, ctx, _, _ = asyncio.run(_run(recs, MultiTurnEpisodes(ep_settings(Flaky)), engines=[engine]))
    assert not failed(ctx) and ctx.counters["env_replayed"] == 3
    for row in range(3):
        seen = [(t, ids, text) for r, t, ids, text in Flaky.steps if r == row]
        # the turns up to the lost one, then a replay of the earlier ones with the very same actions, the lost
        # one again, and the rest
        expect = list(range(lose_at + 1)) + list(range(lose_at + 1)) + list(range(lose_at + 1, 3))
        assert [t for t, _, _ in seen] == expect
        assert seen[lose_at + 1:2 * lose_at + 2] == seen[:lose_at + 1]
    _same_as_the_engine(batch, order, engine, turns=3)


def test_in_loop_a_replay_that_differs_fails_with_the_reason_and_a_reset_env_restarts():
    recs = _flaky(2, lose_at=1, shift=True)
    _, _, ctx, at_write, _ = asyncio.run(_run(recs, MultiTurnEpisodes(ep_settings(Flaky)), engines=[FakeEngine()]))
    assert sorted(at_write) == [0, 1]
    assert all("environment replay diverged at step 0: the observation renders to 6 tokens, recorded 5" in why
               for why in failed(ctx).values()) and len(failed(ctx)) == 2

    recs = _flaky(2, lose_at=1)
    eps = MultiTurnEpisodes(ep_settings(lambda: Flaky("reset")))
    batch, order, ctx, _, _ = asyncio.run(_run(recs, eps, engines=[FakeEngine()]))
    assert not failed(ctx) and ctx.counters["restarted_env_lost"] == 2
    assert all(r[C.EPISODE_TURNS] == 3 for r in _rows(batch, order).values())


def test_replay_needs_a_deterministic_environment():
    with pytest.raises(ValueError, match="restore='replay' needs deterministic=True"):
        EnvironmentFeatures(restore="replay", deterministic=False)
    assert EnvironmentFeatures().restore == "reset"


def _episode(env_factory, record) -> MultiTurn:
    ep = MultiTurnEpisodes(ep_settings(env_factory)).new(0, None, tuple(TOK.encode(record.prompt)), 0, None)
    ep.record = record
    return ep


def _turn(ep, text, version):
    ids = TOK.encode(text)
    ep.take_turn(GenerationResult(ep.request_id, tuple(ep._context), ids, [-0.1] * len(ids), [version] * len(ids),
                                  FinishReason.STOP))


def test_a_stale_restart_keeps_and_replays_the_turns_still_inside_the_bound():
    """Turn 0 sampled on version 5, turn 1 on version 3 (another replica): with the bound at 4 only turn 0 is
    kept; the restart replays it (same action) on a fresh environment and the context is exactly turn 0's."""
    rec = PromptRecord(0, "q0 ", metadata={"turns": 5})
    ep = _episode(Flaky, rec)
    Flaky.steps = []

    async def main():
        assert (await ep.begin()).value == "continue"
        _turn(ep, "ab.", 5)
        assert (await ep.advance()).value == "continue"
        before = list(ep._context)
        _turn(ep, "cd.", 3)
        assert (await ep.advance()).value == "continue"
        unusable = lambda v: v is not None and v < 4  # noqa: E731
        assert ep.fresh_turns(unusable) == 1
        await ep.close()
        ep.restart(ep.fresh_turns(unusable))
        assert ep.turn == 1 and ep.oldest_version() == 5 and list(ep._context) == before
        assert (await ep.begin()).value == "continue"
        assert list(ep._context) == before and ep.attempt == 1 and ep.restarts == 1
        await ep.close()

    asyncio.run(main())
    assert [s[:3] for s in Flaky.steps] == [(0, 0, tuple(TOK.encode("ab."))), (0, 1, tuple(TOK.encode("cd."))),
                                            (0, 0, tuple(TOK.encode("ab.")))]
    # an environment that declares reset keeps nothing
    ep2 = _episode(lambda: Flaky("reset"), rec)

    async def reset_only():
        await ep2.begin()
        _turn(ep2, "ab.", 5)
        await ep2.advance()
        await ep2.close()
        return ep2.fresh_turns(lambda v: False)

    assert asyncio.run(reset_only()) == 0


# -- staleness_basis: request_start, across turns ------------------------------------------------------------


def test_request_start_counts_an_episode_from_its_first_request_across_turns_and_retries():
    rec = PromptRecord(0, "q0 ", metadata={"turns": 5})
    ep = _episode(Flaky, rec)

    async def main():
        await ep.begin()
        ep.origin_version = 2  # what the stage sets at its first dispatch under request_start
        _turn(ep, "ab.", 4)
        await ep.advance()
        assert ep.oldest_version() == 2  # not the tokens' 4
        ep.retry_turn()  # an aborted turn, or its replica died: the episode's start stays
        assert ep.origin_version == 2 and ep.oldest_version() == 2
        assert ep.fresh_turns(lambda v: v is not None and v < 3) == 0  # its start is out: nothing kept
        await ep.close()
        ep.restart()
        assert ep.origin_version is None and ep.oldest_version() is None

    asyncio.run(main())


def test_request_start_is_honoured_for_episodes_through_the_stage():
    """With versions moving every few results and k = 1, every episode written carries the version its first
    request started on, no newer than any of its tokens, inside the bound when written, and declared as the
    row's oldest version."""
    written = []

    def started(ctx, stage):
        ctx.tail = TailPolicy(basis=REQUEST_START)
        stage.guard.tail = ctx.tail
        orig = stage.writer.write

        async def write(req, out):
            written.append((req, out, ctx.version))
            return await orig(req, out)

        stage.writer.write = write

    engines = [FakeEngine(seed=s) for s in range(2)]
    eps = MultiTurnEpisodes(ep_settings(Flaky))
    Flaky.built, Flaky.lost_rows, Flaky.steps = 0, set(), []
    recs = [PromptRecord(i, f"q{i} ", metadata={"turns": 4}) for i in range(16)]
    # bump_every=3: versions move often enough that some episodes start before their first token's version (the
    # count depends on how the loop interleaves sends and results: 0 of 16 at bump_every=5 since a replica's
    # requests of one loop turn go out as one generate call, 4 at 3)
    _, _, ctx, at_write, stage = asyncio.run(_run(recs, eps, engines=engines, k=1, bump_every=3, max_new=5,
                                                  max_inflight=3, started=started))
    assert sorted(at_write) == list(range(16)) and not failed(ctx) and ctx.version >= 3
    assert ctx.counters["requeued_stale_episode"] > 0
    older = 0
    for req, traj, version in written:
        sampled = [v for s in traj.segments if s.sampled for v in s.versions]
        assert req.origin_version is not None and req.origin_version <= min(sampled)
        assert version - req.origin_version <= 1
        _, vrange, _ = stage.writer._episode_columns([(req, traj)])
        assert vrange == [(req.origin_version, max(sampled))]
        older += req.origin_version < min(sampled)
    assert older > 0  # the basis mattered: some episodes started before their oldest token


# -- tool errors ----------------------------------------------------------------------------------------------


def test_tool_error_reasons_reach_the_counters_the_spans_and_the_trajectory():
    """The guess environment (compact format) with random digits: malformed turns are answered, never fail the
    episode, and each step's ``info["reason"]`` is counted per reason, on its step span and per episode."""
    from asyncflow_plugins.envs.guess import GuessEnvConfig, GuessEnvironment

    tok = CharTokenizer("0123456789.<>? q")
    stop = tok.encode(".")[0]
    settings = EpisodeSettings(open_env=lambda: GuessEnvironment(GuessEnvConfig()),
                               renderer=Renderer(tok, (stop,)), decode=tok.decode, max_turns=6,
                               max_episode_tokens=400, step_timeout_s=5.0, owns_reward=True)
    trajs = []

    def started(ctx, stage):
        orig = stage.writer.write

        async def write(req, out):
            trajs.append(out)
            return await orig(req, out)

        stage.writer.write = write

    recs = [PromptRecord(i, f"q{i} ", metadata={"answer": str(100 + i)}) for i in range(8)]
    engine = FakeEngine(seed=2, vocab=10, stop=stop)  # digits, a stop sometimes: leading zeros, cut turns
    _, _, ctx, at_write, _ = asyncio.run(_run(recs, MultiTurnEpisodes(settings), engines=[engine], max_new=4,
                                              started=started, tok=tok))
    assert sorted(at_write) == list(range(8)) and not failed(ctx)
    total = sum(t.info["tool_errors"] for t in trajs)
    assert total > 0 and ctx.counters["episode_tool_errors"] == total
    for t in trajs:
        assert t.info["tool_errors"] == t.info["tool_calls"] - t.info["tool_ok"]  # guess: one call per turn
        assert sum(t.info.get("tool_error_reasons", {}).values()) <= t.info["tool_errors"]
    # every step span with a reason, and the run's counters per reason (their number is bounded)
    marked = Counter(s.args["tool_error"] for s in ctx.timeline.spans
                     if s.name == "step" and "tool_error" in (s.args or {}))
    assert sum(marked.values()) == total
    counted = {k: v for k, v in ctx.counters.items() if k.startswith("tool_error: ")}
    assert sum(counted.values()) == total and len(counted) <= MAX_REASON_KEYS + 1
    for reason, n in marked.items():
        assert counted.get(f"tool_error: {reason}", n) == n  # kept under its own key, or among the others
    assert any("is not a number in canonical form" in r for r in marked)


def test_odd_step_values_are_recorded_reasons_not_crashes():
    class Odd(Flaky):
        async def step(self, action):
            if action.turn == 0:
                return Step(Observation(text=" x:"), reward=0.0, info={"reason": "bad json\nat line 2"})
            if self.record["index"] == 1:
                return Step(Observation(text=" y:"), reward="lots", info={})  # type: ignore[arg-type]
            return Step(None, reward=1.0, done=True, info={"reason": ""})  # empty: no reason

    recs = _flaky(2)
    _, _, ctx, at_write, _ = asyncio.run(_run(recs, MultiTurnEpisodes(ep_settings(Odd)), engines=[FakeEngine()]))
    assert sorted(at_write) == [0, 1]
    assert list(failed(ctx)) == [1] and "a reward that is not a number: 'lots'" in failed(ctx)[1]
    assert ctx.counters["tool_error: bad json"] == 2 and ctx.counters["episode_tool_errors"] == 2


def test_reasons_are_one_short_line_and_the_run_keeps_a_bounded_number_of_them():
    assert step_reason({"reason": "a\nb"}) == "a" and step_reason({"reason": ""}) is None
    assert step_reason({}) is None and step_reason(None) is None and step_reason({"reason": False}) is None
    assert len(step_reason({"reason": "x" * 500})) == 120
    counters: Counter = Counter()
    for i in range(MAX_REASON_KEYS + 5):
        merge_events(counters, Counter({f"tool_error: r{i}": 1, "episode_tool_errors": 1}))
    assert sum(1 for k in counters if k.startswith("tool_error: ")) == MAX_REASON_KEYS + 1
    assert counters[OTHER_REASONS] == 5 and counters["episode_tool_errors"] == MAX_REASON_KEYS + 5
    merge_events(counters, Counter({"tool_error: r0": 2}))  # a known reason keeps its own key
    assert counters["tool_error: r0"] == 3


def test_settings_refuse_a_negative_rebuild_limit():
    with pytest.raises(ValueError, match="max_env_rebuilds"):
        EpisodeSettings(open_env=Flaky, renderer=Renderer(TOK, (STOP,)), decode=TOK.decode, max_env_rebuilds=-1)


# -- the conformance check of replay ----------------------------------------------------------------------


class _Counting(Environment):
    """Declares replay; ``drift``: each new instance answers with its own number (a replay cannot match)."""

    made = 0
    features = EnvironmentFeatures(owns_reward=True, restore="replay")

    def __init__(self, drift: bool) -> None:
        type(self).made += 1
        self.number = type(self).made if drift else 0

    async def reset(self, record, *, seed):
        return Observation(text=f"{record['prompt']}{seed}")

    async def step(self, action):
        return Step(Observation(text=f"{action.text}{self.number}"), reward=float(action.turn),
                    done=action.turn >= 1)


@pytest.mark.parametrize("drift", [False, True])
def test_the_environment_spec_catches_an_environment_whose_replay_differs(drift):
    from asyncflow_spec import EnvironmentSpec

    class Spec(EnvironmentSpec):
        records = ({"index": 0, "prompt": "p"},)
        turns = ("a", "b")

    check = Spec().test_replay_rebuilds_the_same_observations
    if drift:
        with pytest.raises(AssertionError, match="restore='replay' needs the same answers"):
            check(lambda: _Counting(drift))
    else:
        check(lambda: _Counting(drift))
