"""An agentic episode longer than its row's lease keeps the row: renewed per turn, generated and written once.

The store and the run share a fake clock that only the environment moves
(each step takes ``STEP_S`` of it), so the episodes below last twice the
lease without the test waiting for anything. Before lease renewal the
lease expired mid-episode: the row went back to free, and the episode's
acknowledgement failed (the run halted) or the row was generated twice.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import torch
from asyncflow_spec.store import FakeClock

from asyncflow_core import columns as C
from asyncflow_core.flow.episode import EpisodeSettings, MultiTurnEpisodes
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.render import Renderer
from asyncflow_core.flow.rollout_stage import RolloutStage
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.flow.tokenizer import CharTokenizer
from asyncflow_core.interfaces.environment import Environment, EnvironmentFeatures, Observation, Step
from asyncflow_core.interfaces.features import RolloutFeatures
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.types import FinishReason, GenerationResult, PromptRecord, RaggedTensor, SamplingParams

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 :."
TOK = CharTokenizer(ALPHABET)
STOP = ALPHABET.index(".")
LEASE_S = 10.0
STEP_S = 2.0
TURNS = 5
ROWS = 2  #: both in one lease: 2 rows x 5 steps x 2 s = 20 s of the fake clock, twice the lease


class InstantEngine:
    """Answers every request at once with two tokens; records each request id it was given."""

    def __init__(self) -> None:
        self.features = RolloutFeatures()
        self.version = 0
        self.requests: list[str] = []

    async def abort(self, ids):
        raise AssertionError("nothing should be aborted")

    async def generate(self, requests):
        for req in requests:
            self.requests.append(req.request_id)
            await asyncio.sleep(0)
            yield GenerationResult(req.request_id, req.prompt_token_ids, [0, STOP], [-0.1, -0.1], [0, 0],
                                   FinishReason.STOP)


class NoTransport:
    async def receive(self, *, min_version, deadline_s):
        raise AssertionError("no weight load expected")
        yield


def slow_env(clock: FakeClock, step_s: float) -> type[Environment]:
    class SlowEnv(Environment):
        """``TURNS`` steps, each taking ``step_s`` of the shared fake clock."""

        @property
        def features(self):
            return EnvironmentFeatures(owns_reward=True)

        async def reset(self, record, *, seed):
            return Observation(text=record["prompt"])

        async def step(self, action):
            clock.advance(step_s)
            done = action.turn + 1 >= TURNS
            return Step(None if done else Observation(text=" ok:"), reward=1.0, done=done)

        async def close(self):
            pass

    return SlowEnv


async def _run_slow_episodes(step_s: float = STEP_S, rows: int = ROWS):
    clock = FakeClock()
    store = InProcessStore(capacity=64, clock=clock, lease_s=LEASE_S)
    ctx = FlowContext(store=store, timeline=Timeline(clock), ledger=Ledger(), k=1, prompts_per_step=rows, n=1,
                      clock=clock, max_failure_rate=1.0)
    settings = EpisodeSettings(open_env=slow_env(clock, step_s), renderer=Renderer(TOK, (STOP,)), decode=TOK.decode,
                               max_turns=TURNS, max_episode_tokens=400, step_timeout_s=None, owns_reward=True)
    engine = InstantEngine()
    stage = RolloutStage([engine], NoTransport(), SamplingParams(max_new_tokens=4, stop_token_ids=(STOP,)),
                         max_inflight=4, rows_per_lease=rows, lease_s=LEASE_S, write_interval_s=0.001,
                         deadline_s=1.0, episodes=MultiTurnEpisodes(settings))
    stage.bind(ctx)
    await store.register_task("feeder", produces=(C.PROMPT_IDS, C.GROUP_ID))
    await store.register_task("rollout", consumes=stage.consumes, produces=stage.produces)
    await store.register_task("reader", consumes=(C.PROMPT_IDS, *stage.produces))
    recs = [PromptRecord(i, f"q{i} ") for i in range(rows)]
    gids = [ctx.ledger.admit(i, r).group_id for i, r in enumerate(recs)]
    await store.put({C.PROMPT_IDS: RaggedTensor.from_sequences([torch.tensor(TOK.encode(r.prompt)) for r in recs]),
                     C.GROUP_ID: torch.tensor(gids, dtype=torch.int64)}, group_ids=torch.tensor(gids))
    await store.end_stream()
    written: Counter[int] = Counter()
    orig_write = stage.writer.write

    async def write(req, out):
        written[req.row] += 1
        return await orig_write(req, out)

    stage.writer.write = write  # type: ignore[method-assign]
    run = asyncio.ensure_future(stage.run())
    stop = asyncio.ensure_future(ctx.stop.wait())
    await asyncio.wait([run, stop], timeout=60, return_when=asyncio.FIRST_COMPLETED)  # hang guards, not timings
    stop.cancel()
    if ctx.stop.is_set():  # halted: the stage winds down (closes its environments) after the stop
        await asyncio.wait([run], timeout=60)
    assert run.done(), "the stage did not finish"
    run.result()
    turns = None
    if ctx.stop_reason is None:
        meta = await store.get_meta("reader", (C.PROMPT_IDS, C.EPISODE_TURNS), rows, partial=True, timeout=0)
        turns = (await store.get(meta))[C.EPISODE_TURNS].tolist()
    return clock, ctx, engine, written, turns, await store.stats()


def _first_turns(engine: InstantEngine) -> Counter[str]:
    """How many times each row's episode started (its first turn's requests)."""
    return Counter(rid.split("-")[0] for rid in engine.requests if rid.endswith("-turn0"))


def test_an_episode_twice_as_long_as_its_lease_is_generated_and_written_once():
    clock, ctx, engine, written, turns, stats = asyncio.run(_run_slow_episodes())
    assert ctx.stop_reason is None, ctx.stop_reason
    assert clock.now == ROWS * TURNS * STEP_S > LEASE_S  # the episodes outlived the lease they were granted
    assert written == {r: 1 for r in range(ROWS)}
    assert turns == [TURNS] * ROWS and ctx.counters["episodes_done"] == ROWS
    assert _first_turns(engine) == {f"row{r}": 1 for r in range(ROWS)}, engine.requests  # each episode ran once
    assert len(engine.requests) == ROWS * TURNS
    assert stats["leases_renewed"] >= 2 and stats["leases_expired"] == 0 and stats["rows_done"] >= ROWS


def test_a_turn_longer_than_the_lease_stops_the_run_with_the_fix_instead_of_generating_the_row_twice():
    clock, ctx, engine, written, turns, stats = asyncio.run(_run_slow_episodes(step_s=LEASE_S + 2.0, rows=1))
    assert ctx.stop_reason is not None and "ended before its episode did" in ctx.stop_reason
    assert ctx.stop_reason.endswith("raise pipeline.lease_s")
    assert not written and _first_turns(engine) == {"row0": 1}
