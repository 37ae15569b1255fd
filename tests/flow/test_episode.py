"""Multi-turn episodes through the rollout stage: a fake token-level engine, in-test environments, a real store.

The engine samples token by token (yielding to the loop between tokens), so
in-flight aborts, resumes with a prefix and weight versions that move
mid-turn all happen; it records every token it returned, and the tests read
the rows back from the store and compare.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_core import columns as C
from asyncflow_core.errors import AsyncflowError
from asyncflow_core.flow.episode import EpisodeSettings, MultiTurn, MultiTurnEpisodes, SingleTurnEpisodes
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.render import Renderer
from asyncflow_core.flow.rollout_stage import RolloutStage
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.flow.tokenizer import CharTokenizer
from asyncflow_core.interfaces.environment import Environment, EnvironmentFeatures, Observation, Step
from asyncflow_core.interfaces.features import RolloutFeatures
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.types import FinishReason, GenerationResult, PromptRecord, SamplingParams

try:
    from asyncflow_core.errors import EnvironmentFailure
except ImportError:  # until the environment plugin kind lands: any AsyncflowError reads the same
    class EnvironmentFailure(AsyncflowError):  # type: ignore[no-redef]
        pass

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 :."
TOK = CharTokenizer(ALPHABET)
STOP = ALPHABET.index(".")


class FakeEngine:
    """Samples token by token; ``version`` is its weights' version (the test moves it); supports abort/resume."""

    def __init__(self, *, resume: bool = True, abort: bool = True, seed: int = 0, vocab: int = len(ALPHABET) - 1,
                 stop: int = STOP, low: int = 0) -> None:
        self.features = RolloutFeatures(supports_abort=abort, supports_resume_prefix=resume)
        self.vocab, self.stop, self.low = vocab, stop, low  #: tokens drawn from [low, vocab) minus the stop token
        self.version = 0
        self.seed = seed
        self._aborted: set[str] = set()
        self.returned: dict[str, GenerationResult] = {}  #: request id -> what it returned
        self.prompts: dict[str, tuple[int, ...]] = {}  #: request id -> the prompt it was given

    async def abort(self, ids):
        self._aborted.update(ids)

    async def generate(self, requests):
        queue: asyncio.Queue = asyncio.Queue()

        async def one(req):
            self.prompts[req.request_id] = req.prompt_token_ids
            rng = random.Random(hash((self.seed, req.prompt_token_ids, req.prefix_token_ids)))
            toks, lps, vers = list(req.prefix_token_ids), list(req.prefix_logprobs), list(req.prefix_versions)
            want = rng.randint(1, req.sampling.max_new_tokens)
            stops = rng.random() < 0.75
            reason = FinishReason.LENGTH
            while len(toks) < want:
                await asyncio.sleep(0)
                if req.request_id in self._aborted:
                    reason = FinishReason.ABORT
                    break
                last = len(toks) == want - 1
                t = self.stop if (last and stops) else rng.randrange(self.low, self.vocab)
                t = t if (t != self.stop or (last and stops)) else self.low
                toks.append(t)
                lps.append(-rng.random())
                vers.append(self.version)
                if t == self.stop:
                    reason = FinishReason.STOP
                    break
            res = GenerationResult(req.request_id, req.prompt_token_ids, toks, lps, vers, reason)
            self.returned[req.request_id] = res
            await queue.put(res)

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            for _ in requests:
                yield await queue.get()
        finally:
            for t in tasks:
                t.cancel()


class NoTransport:
    async def receive(self, *, min_version, deadline_s):  # the tests move versions by hand
        raise AssertionError("no weight load expected")
        yield


class ScriptEnv(Environment):
    """Turns from the record: ``turns`` steps; ``fail`` = (turn, kind) makes that step fail."""

    opened = 0
    closed = 0

    def __init__(self, owns_reward: bool = True, step_s: float = 0.0) -> None:
        type(self).opened += 1
        self._features = EnvironmentFeatures(owns_reward=owns_reward)
        self.step_s = step_s
        self.record = None

    @property
    def features(self):
        return self._features

    async def reset(self, record, *, seed):
        self.record = record
        if record.get("fail") == ("reset", "raise"):
            raise RuntimeError("the sandbox did not start")
        return Observation(text=record["prompt"])

    async def step(self, action):
        rec = self.record
        if self.step_s:
            await asyncio.sleep(self.step_s)
        kind = rec.get("fail", (None, None))
        if kind[0] == action.turn:
            if kind[1] == "raise":
                raise ValueError("tool crashed")
            if kind[1] == "timeout":
                await asyncio.sleep(3600)
            if kind[1] == "malformed":
                raise EnvironmentFailure("malformed tool call: no closing tag")
            if kind[1] == "oversize":
                return Step(Observation(text="a" * 500), reward=0.0)
        done = action.turn + 1 >= rec["turns"]
        return Step(None if done else Observation(text=f" ok{action.turn}:"), reward=0.5 + action.turn, done=done,
                    info={"tool_calls": 1, "tool_ok": action.turn % 2 == 0})

    async def close(self):
        type(self).closed += 1


def records(n: int, turns: int = 3, fail: dict | None = None) -> list[PromptRecord]:
    fail = fail or {}
    return [PromptRecord(i, f"q{i} ", metadata={"turns": turns, **({"fail": fail[i]} if i in fail else {})})
            for i in range(n)]


def failed(ctx) -> dict[int, str]:
    """Row id -> the one-line reason of every settled row."""
    return {r: str(v) for r, v in ctx.outcomes.reasons.items()}


def make_ctx(store, k: int = 1, policy: str = "requeue") -> FlowContext:
    return FlowContext(store=store, timeline=Timeline(time.monotonic), ledger=Ledger(), k=k, prompts_per_step=4, n=1,
                       clock=time.monotonic, stale_policy=policy, max_failure_rate=1.0)


def ep_settings(env_factory, **kw) -> EpisodeSettings:
    opts = {"max_turns": 8, "max_episode_tokens": 400, "step_timeout_s": 5.0, "owns_reward": True}
    opts.update(kw)
    return EpisodeSettings(open_env=env_factory, renderer=Renderer(TOK, (STOP,)), decode=TOK.decode, **opts)


async def _run(recs, episodes, *, engines, k=1, policy="requeue", bump_every=0, max_new=6, max_inflight=4,
               started=None, tok=TOK):
    """Run the stage over ``recs`` (one row each); ``bump_every``: move the trainer and engine versions forward
    after every that many engine results. Returns (columns read back, ctx, versions at write per row)."""
    store = InProcessStore(capacity=4096)
    ctx = make_ctx(store, k, policy)
    stage = RolloutStage(engines, NoTransport(), SamplingParams(max_new_tokens=max_new, stop_token_ids=(STOP,)),
                         max_inflight=max_inflight, rows_per_lease=4, lease_s=60.0, write_interval_s=0.001,
                         deadline_s=1.0, episodes=episodes)
    stage.bind(ctx)
    if started is not None:
        task = started(ctx, stage)
        if asyncio.iscoroutine(task):
            task = asyncio.ensure_future(task)
    await store.register_task("feeder", produces=(C.PROMPT_IDS, C.GROUP_ID))
    await store.register_task("rollout", consumes=stage.consumes, produces=stage.produces)
    await store.register_task("reader", consumes=(C.PROMPT_IDS, *stage.produces))
    gids = []
    for i, rec in enumerate(recs):
        g = ctx.ledger.admit(i, rec)
        gids.append(g.group_id)
    prompts = [torch.tensor(tok.render([{"role": "user", "content": r.prompt}], "test") if hasattr(tok, "render")
                            else tok.encode(r.prompt)) for r in recs]
    from asyncflow_core.types import RaggedTensor
    await store.put({C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
                     C.GROUP_ID: torch.tensor(gids, dtype=torch.int64)}, group_ids=torch.tensor(gids))
    await store.end_stream()
    at_write: dict[int, int] = {}  #: row -> the trainer's version when the stage handed it to the writer
    orig_write = stage.writer.write

    async def write(req, out):
        assert req.row not in at_write, f"row {req.row} written twice"
        at_write[req.row] = ctx.version
        return await orig_write(req, out)

    stage.writer.write = write  # type: ignore[method-assign]
    bumper = None
    if bump_every:
        async def bump():
            seen = 0
            while True:
                await asyncio.sleep(0)
                total = sum(1 for e in engines for res in e.returned.values()
                            if res.finish_reason is not FinishReason.ABORT)
                if total >= seen + bump_every and ctx.version < 12:
                    seen = total
                    ctx.version += 1
                    for e in engines:
                        e.version = ctx.version
                    await ctx.notify()
        bumper = asyncio.ensure_future(bump())
    run = asyncio.ensure_future(stage.run())
    stop = asyncio.ensure_future(ctx.stop.wait())
    await asyncio.wait([run, stop], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    assert ctx.stop_reason is None, ctx.stop_reason
    assert run.done(), "the stage did not finish within 60 s"
    run.result()
    stop.cancel()
    if bumper:
        bumper.cancel()
    meta = await store.get_meta("reader", (C.PROMPT_IDS, *stage.produces), len(recs), partial=True)
    batch = await store.get(meta)
    order = meta.row_ids.tolist()
    return batch, order, ctx, at_write, stage


def _rows(batch, order):
    out = {}
    for i, row in enumerate(order):
        out[row] = {c: (batch[c][i].tolist() if c in batch.columns else None) for c in batch.columns}
    return out


def test_a_multi_turn_episode_is_written_with_mask_turns_rewards_and_versions():
    ScriptEnv.opened = ScriptEnv.closed = 0
    eng = FakeEngine()
    eps = MultiTurnEpisodes(ep_settings(ScriptEnv))
    batch, order, ctx, _, _ = asyncio.run(_run(records(6), eps, engines=[eng]))
    rows = _rows(batch, order)
    assert sorted(rows) == list(range(6)) and not failed(ctx)
    for row, r in rows.items():
        assert r[C.EPISODE_TURNS] == 3 and r[C.TURN_REWARDS] == pytest.approx([0.5, 1.5, 2.5])
        assert r[C.REWARD] == pytest.approx(4.5)  # the environment owns it: the sum of the step rewards
        assert r[C.EPISODE_TOOL_CALLS] == 3 and r[C.EPISODE_TOOL_OK] == 2
        mask, turns, ids = r[C.LOSS_MASK], r[C.TURN_IDS], r[C.RESPONSE_IDS]
        assert len(mask) == len(turns) == len(ids) == len(r[C.BEHAVIOR_LOGPROBS]) == len(r[C.RESPONSE_VERSIONS])
        # observed tokens: " ok<t>:" after turn t, with loss mask 0, log-prob 0 and the turn before them
        obs = [i for i, m in enumerate(mask) if not m]
        assert TOK.decode([ids[i] for i in obs]) == " ok0: ok1:"
        assert all(r[C.BEHAVIOR_LOGPROBS][i] == 0.0 for i in obs)
        assert [turns[i] for i in obs] == [0] * 5 + [1] * 5 and sorted(set(turns)) == [0, 1, 2]
        assert r[C.EPISODE_MASKED_FRAC] == pytest.approx(10 / len(ids))
    # every environment opened was closed
    assert ScriptEnv.opened == ScriptEnv.closed == 6
    assert ctx.counters["episodes_done"] == 6


@pytest.mark.parametrize("kind,reason", [
    (("reset", "raise"), "environment reset raised RuntimeError: the sandbox did not start"),
    ((1, "raise"), "environment step 1 raised ValueError: tool crashed"),
    ((0, "timeout"), "environment step 0 took longer than 0.2s"),
    ((1, "malformed"), "environment step 1: malformed tool call: no closing tag"),
    ((0, "oversize"), "oversize episode:"),
])
def test_a_failing_episode_is_recorded_with_its_reason_and_written_once_as_a_placeholder(kind, reason):
    ScriptEnv.opened = ScriptEnv.closed = 0
    eps = MultiTurnEpisodes(ep_settings(ScriptEnv, step_timeout_s=0.2, max_episode_tokens=200))
    batch, order, ctx, at_write, _ = asyncio.run(_run(records(4, fail={2: kind}), eps, engines=[FakeEngine()]))
    rows = _rows(batch, order)
    assert sorted(rows) == [0, 1, 2, 3] and sorted(at_write) == [0, 1, 2, 3]  # nothing lost, nothing twice
    assert list(failed(ctx)) == [2] and reason in failed(ctx)[2], failed(ctx)
    assert rows[2][C.RESPONSE_IDS] == [] and rows[2][C.LOSS_MASK] == []  # the placeholder
    assert all(rows[i][C.EPISODE_TURNS] == 3 for i in (0, 1, 3))
    assert ScriptEnv.opened == ScriptEnv.closed == 4


def test_max_turns_ends_the_episode_truncated_without_the_last_observation():
    eps = MultiTurnEpisodes(ep_settings(ScriptEnv, max_turns=2))
    batch, order, ctx, _, _ = asyncio.run(_run(records(3, turns=5), eps, engines=[FakeEngine()]))
    for r in _rows(batch, order).values():
        assert r[C.EPISODE_TURNS] == 2 and r[C.TRUNCATED] is True
        assert r[C.LOSS_MASK][-1] is True  # it ends with the policy's turn, not an observation


def test_every_turn_request_is_all_tokens_so_far_and_the_row_is_what_the_engine_returned():
    eng = FakeEngine(seed=3)
    eps = MultiTurnEpisodes(ep_settings(ScriptEnv))
    batch, order, ctx, _, _ = asyncio.run(_run(records(8, turns=4), eps, engines=[eng], max_new=5))
    rows = _rows(batch, order)
    finals = {}
    for rid, res in eng.returned.items():
        if res.finish_reason is not FinishReason.ABORT:
            finals[rid] = res
    for row, r in rows.items():
        prompt = batch[C.PROMPT_IDS][order.index(row)].tolist()
        full = prompt + r[C.RESPONSE_IDS]
        # each turn: the engine was given exactly the tokens before it, and returned exactly the tokens after
        starts = [i for i, (m, prev) in enumerate(zip(r[C.LOSS_MASK], [False] + r[C.LOSS_MASK])) if m and not prev]
        assert len(starts) == 4
        for t, s in enumerate(starts):
            res = finals[f"row{row}-try0-turn{t}"]
            assert list(eng.prompts[f"row{row}-try0-turn{t}"]) == full[:len(prompt) + s]
            n = len(res.token_ids)
            assert r[C.RESPONSE_IDS][s:s + n] == list(res.token_ids)
            assert r[C.BEHAVIOR_LOGPROBS][s:s + n] == pytest.approx(list(res.logprobs))
            assert r[C.RESPONSE_VERSIONS][s:s + n] == list(res.versions)


def test_aborted_turns_resume_with_their_prefix_and_the_row_keeps_both_versions():
    """Weight updates abort turns in flight (as a pause-abort update does) and move the version: each turn
    resumes after its prefix, and the row holds exactly the tokens of each turn's final result, with the
    version of every token (some turns span two versions)."""
    eng = FakeEngine(seed=5)
    eps = MultiTurnEpisodes(ep_settings(ScriptEnv))

    async def updates(ctx, stage):
        for _ in range(200):
            for _ in range(7):
                await asyncio.sleep(0)
            r = stage.replicas[0]
            if r.inflight:
                await stage.pool.abort(r, list(r.inflight))
                ctx.version += 1
                eng.version = ctx.version

    batch, order, ctx, at_write, _ = asyncio.run(_run(records(8, turns=3), eps, engines=[eng], k=1000, max_new=8,
                                                      started=updates))
    rows = _rows(batch, order)
    assert ctx.counters["resumed_partial"] > 0 and not failed(ctx)
    spans_two = 0
    for row, r in rows.items():
        prompt = batch[C.PROMPT_IDS][order.index(row)].tolist()
        finals = sorted((rid for rid, res in eng.returned.items()
                         if rid.startswith(f"row{row}-") and res.finish_reason is not FinishReason.ABORT),
                        key=lambda rid: int(rid.rsplit("turn", 1)[1]))
        assert len(finals) == 3
        s = 0
        for rid in finals:
            res = eng.returned[rid]
            assert list(eng.prompts[rid]) == prompt + r[C.RESPONSE_IDS][:s]
            n = len(res.token_ids)
            assert r[C.RESPONSE_IDS][s:s + n] == list(res.token_ids) and all(r[C.LOSS_MASK][s:s + n])
            assert r[C.RESPONSE_VERSIONS][s:s + n] == list(res.versions)
            spans_two += len(set(res.versions)) > 1
            s += n
            while s < len(r[C.LOSS_MASK]) and not r[C.LOSS_MASK][s]:
                s += 1
        sampled = [v for v, m in zip(r[C.RESPONSE_VERSIONS], r[C.LOSS_MASK]) if m]
        assert min(r[C.RESPONSE_VERSIONS]) == min(sampled)  # observed tokens carry a sampled turn's version
    assert spans_two > 0


@pytest.mark.parametrize("policy", ["requeue", "drop"])
@pytest.mark.parametrize("k", [0, 1])
def test_versions_moving_during_episodes_never_give_a_row_outside_the_bound(policy, k):
    """The trainer (and the engines) move a version every few results: every row written is inside the bound
    at the version it was written, over every sampled token of every turn; episodes that fell out restarted
    from reset (requeue) or were dropped (drop), and are counted."""
    engines = [FakeEngine(seed=s) for s in range(2)]
    eps = MultiTurnEpisodes(ep_settings(ScriptEnv, owns_reward=False))
    batch, order, ctx, at_write, _ = asyncio.run(_run(records(24, turns=4), eps, engines=engines, k=k,
                                                      policy=policy, bump_every=7, max_new=6, max_inflight=3))
    rows = _rows(batch, order)
    assert sorted(rows) == list(range(24)) and sorted(at_write) == list(range(24))
    assert C.REWARD not in batch.columns  # a reward plugin scores it
    violations = 0
    trained = 0
    for row, r in rows.items():
        if row in failed(ctx):
            assert r[C.RESPONSE_IDS] == []
            continue
        trained += 1
        sampled = [v for v, m in zip(r[C.RESPONSE_VERSIONS], r[C.LOSS_MASK]) if m]
        violations += at_write[row] - min(sampled) > k
    assert violations == 0
    assert ctx.version >= 3  # versions really moved during the episodes
    restarted = ctx.counters["requeued_stale_episode"] + ctx.counters["dropped_stale_episode"]
    assert restarted > 0, ctx.counters
    if policy == "drop":
        assert ctx.counters["dropped_stale_episode"] == len(failed(ctx)) and trained == 24 - len(failed(ctx))
    else:
        assert not failed(ctx) and trained == 24


def test_a_slow_tool_holds_neither_dispatch_nor_other_episodes():
    """Episode 0's first step waits until every other episode is written: if a step blocked dispatch or the
    replica's result stream, the others could never finish (the wait_for in _run fails instead of hanging)."""
    release = asyncio.Event()

    class Slow(ScriptEnv):
        async def step(self, action):
            if self.record["index"] == 0 and action.turn == 0:
                await release.wait()
            return await super().step(action)

    async def watch(ctx):
        while ctx.counters["episodes_done"] < 5:
            await asyncio.sleep(0.001)
        release.set()

    eps = MultiTurnEpisodes(ep_settings(Slow, step_timeout_s=30.0))
    batch, order, ctx, _, _ = asyncio.run(_run(records(6), eps, engines=[FakeEngine()], max_inflight=2,
                                               started=lambda ctx, stage: watch(ctx)))
    assert ctx.counters["episodes_done"] == 6 and release.is_set()


def test_the_single_turn_factory_is_the_default_and_writes_the_rollout_columns_only():
    eng = FakeEngine()
    batch, order, ctx, _, stage = asyncio.run(_run(records(5), SingleTurnEpisodes(), engines=[eng]))
    assert set(batch.columns) >= set(stage.produces) and stage.produces == (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS,
                                                                            C.RESPONSE_VERSIONS, C.TRUNCATED)
    for i, row in enumerate(order):
        res = eng.returned[f"row{row}-try0"]
        assert batch[C.RESPONSE_IDS][i].tolist() == list(res.token_ids)


def test_a_restarted_episode_gets_a_fresh_environment_and_the_same_seed():
    seen: list[tuple[int, int]] = []

    class Seeds(ScriptEnv):
        async def reset(self, record, *, seed):
            seen.append((record["index"], seed))
            return await super().reset(record, seed=seed)

    eps = MultiTurnEpisodes(ep_settings(Seeds))
    ep = eps.new(0, None, (1, 2), 0, None)
    assert isinstance(ep, MultiTurn)
    ep.record = records(1)[0]

    async def main():
        assert (await ep.begin()).value == "continue"
        await ep.close()
        ep.restart()
        assert (await ep.begin()).value == "continue"
        await ep.close()

    asyncio.run(main())
    assert len(seen) == 2 and seen[0] == seen[1] and ep.attempt == 1 and ep.restarts == 1


def test_build_episodes_is_single_turn_without_an_environment_section_and_multi_turn_with_one():
    from types import SimpleNamespace as NS

    from asyncflow_core.flow.episode import build_episodes

    assert isinstance(build_episodes(NS(components={}, config=NS(seed=1)), TOK), SingleTurnEpisodes)
    record = NS(factory=lambda opts: ScriptEnv(), declared_features=EnvironmentFeatures(owns_reward=True))
    comp = NS(registered=NS(record=record), options=None)
    cfg = NS(seed=3, environment=NS(max_turns=4, max_episode_tokens=100, step_timeout_s=2.0))
    eps = build_episodes(NS(components={"environment": comp}, config=cfg), TOK, None, stop_ids=(STOP,))
    assert isinstance(eps, MultiTurnEpisodes) and C.REWARD in eps.columns and C.LOSS_MASK in eps.columns
    s = eps.settings
    assert (s.max_turns, s.max_episode_tokens, s.step_timeout_s, s.seed) == (4, 100, 2.0, 3)
    assert isinstance(s.open_env(), ScriptEnv) and s.renderer.stop_ids == {STOP}


# -- the full stage with a checkpoint's tokenizer and chat template ------------------------------------------


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from asyncflow_core.flow.tokenizer import HFTokenizer
    from asyncflow_plugins.hf.testing import build_local_chat_checkpoint

    path = build_local_chat_checkpoint(tmp_path_factory.mktemp("chatml"))
    return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), path=str(path))


def _tool_text(index: int, turn: int) -> str:
    return f"result {index * 7 + turn} ok"


class ChatEnv(ScriptEnv):
    async def reset(self, record, *, seed):
        self.record = record
        return Observation(messages=[{"role": "user", "content": record["prompt"]}])

    async def step(self, action):
        rec = self.record
        done = action.turn + 1 >= rec["turns"]
        msgs = [{"role": "tool", "content": _tool_text(rec["index"], action.turn)}]
        return Step(None if done else Observation(messages=msgs), reward=1.0, done=done)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), replicas=st.integers(1, 3), k=st.integers(0, 2), bump=st.sampled_from([0, 4]),
       policy=st.sampled_from(["requeue", "drop"]))
def test_through_the_stage_each_turn_is_what_the_engine_returned_for_exactly_the_trained_prefix(
        chatml, seed, replicas, k, bump, policy):
    """Episodes with a ChatML checkpoint through the whole stage (several replicas, versions moving, restarts):
    every sampled run of a written row is what an engine returned for exactly the trained tokens before it,
    every observed run is the tool's message as the template renders it, and each row is inside the bound."""
    stop = chatml.hf.convert_tokens_to_ids("<|im_end|>")
    engines = [FakeEngine(seed=seed + i, vocab=len(chatml.hf), stop=stop, low=3) for i in range(replicas)]
    s = EpisodeSettings(open_env=ChatEnv, renderer=Renderer(chatml, (stop,)), decode=chatml.decode, max_turns=6,
                        max_episode_tokens=None, step_timeout_s=5.0, owns_reward=True)
    recs = [PromptRecord(i, f"what is {i} + {i}", metadata={"turns": 1 + (seed + i) % 4}) for i in range(10)]
    batch, order, ctx, at_write, _ = asyncio.run(_run(recs, MultiTurnEpisodes(s), engines=engines, k=k,
                                                      policy=policy, bump_every=bump, max_new=6, max_inflight=2,
                                                      tok=chatml))
    given_ = {}
    for e in engines:
        for rid, res in e.returned.items():
            if res.finish_reason is not FinishReason.ABORT:
                given_.setdefault(tuple(e.prompts[rid]), []).append(list(res.token_ids))
    rows = _rows(batch, order)
    assert sorted(rows) == list(range(10)) and sorted(at_write) == list(range(10))
    for row, r in rows.items():
        if row in failed(ctx):
            assert policy == "drop" and r[C.RESPONSE_IDS] == []
            continue
        prompt = batch[C.PROMPT_IDS][order.index(row)].tolist()
        assert prompt == chatml.render([{"role": "user", "content": recs[row].prompt}], "test")
        full, mask = prompt + r[C.RESPONSE_IDS], r[C.LOSS_MASK]
        runs, i = [], 0
        while i < len(mask):
            j = i
            while j < len(mask) and mask[j] == mask[i]:
                j += 1
            runs.append((mask[i], i, j))
            i = j
        turns = [x for x in runs if x[0]]
        assert len(turns) == r[C.EPISODE_TURNS] == recs[row].metadata["turns"]
        for sampled, a, b in runs:
            if sampled:
                assert r[C.RESPONSE_IDS][a:b] in given_.get(tuple(full[:len(prompt) + a]), []), (row, a)
            else:
                text = chatml.hf.decode(r[C.RESPONSE_IDS][a:b])
                turn = r[C.TURN_IDS][a]
                assert f"<|im_start|>tool\n{_tool_text(row, turn)}<|im_end|>\n<|im_start|>assistant\n" in text
        sampled_v = [v for v, m in zip(r[C.RESPONSE_VERSIONS], mask) if m]
        assert at_write[row] - min(sampled_v) <= k
