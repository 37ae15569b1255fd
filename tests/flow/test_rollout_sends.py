"""The rollout stage sends the requests a replica gets in one turn of the event loop as one generate call.

An engine hands over the rows that finished together in one go, and the
stage assigns each freed slot as each result comes in. Before, every such
assignment was a generate call of its own (a task, a call into the engine,
a wake-up of its worker: about 30 calls a step in the arithmetic example);
the assignments are unchanged (the seeded simulator keeps its recorded
schedule, tests/test_sim_pinned.py), only the calls are merged.
"""

from __future__ import annotations

import asyncio

import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.rollout_stage import RolloutStage
from asyncflow_core.flow.single_turn import SingleTurn
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.interfaces.features import RolloutFeatures
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.types import FinishReason, GenerationResult, PromptRecord, RaggedTensor, SamplingParams

SLOTS = 4
ROWS = 12


class BurstEngine:
    """Finishes every request of a call together, after one turn of the loop; records each call's request ids.

    A first attempt is aborted after one token (as a pause for a weight update aborts what is in flight): the
    stage resumes each from its result, so every result of the burst frees a slot and re-queues a request.
    """

    def __init__(self) -> None:
        self.features = RolloutFeatures(supports_resume_prefix=True)
        self.version = 0
        self.calls: list[list[str]] = []

    async def generate(self, requests):
        self.calls.append([r.request_id for r in requests])
        await asyncio.sleep(0)
        for req in requests:  # no await between results: one burst, as an engine delivers rows finished together
            if req.request_id.endswith("-try0"):
                yield GenerationResult(req.request_id, req.prompt_token_ids, [1], [-0.5], [0], FinishReason.ABORT)
            else:
                yield GenerationResult(req.request_id, req.prompt_token_ids, [*req.prefix_token_ids, 2],
                                       [*req.prefix_logprobs, -0.5], [*req.prefix_versions, 0], FinishReason.STOP)


class SilentEngine(BurstEngine):
    """Records each call and never answers (the test looks only at what was sent)."""

    async def generate(self, requests):
        self.calls.append([r.request_id for r in requests])
        await asyncio.Event().wait()
        yield


class NoTransport:
    async def receive(self, *, min_version, deadline_s):
        raise AssertionError("no weight load expected")
        yield


def _stage(engine: BurstEngine, store: InProcessStore) -> tuple[RolloutStage, FlowContext]:
    clock = asyncio.get_running_loop().time
    ctx = FlowContext(store=store, timeline=Timeline(clock), ledger=Ledger(), k=1, prompts_per_step=ROWS, n=1,
                      clock=clock, max_failure_rate=1.0)
    stage = RolloutStage([engine], NoTransport(), SamplingParams(max_new_tokens=2), max_inflight=SLOTS,
                         rows_per_lease=ROWS, lease_s=60.0, write_interval_s=0.001, deadline_s=1.0)
    stage.bind(ctx)
    return stage, ctx


async def _run() -> tuple[BurstEngine, dict[int, list[int]]]:
    store = InProcessStore(capacity=64)
    engine = BurstEngine()
    stage, ctx = _stage(engine, store)
    await store.register_task("feeder", produces=(C.PROMPT_IDS, C.GROUP_ID))
    await store.register_task("rollout", consumes=stage.consumes, produces=stage.produces)
    await store.register_task("reader", consumes=(C.GROUP_ID, *stage.produces))
    gids = [ctx.ledger.admit(i, PromptRecord(i, f"q{i}")).group_id for i in range(ROWS)]
    await store.put({C.PROMPT_IDS: RaggedTensor.from_sequences([torch.tensor([7, i]) for i in range(ROWS)]),
                     C.GROUP_ID: torch.tensor(gids, dtype=torch.int64)}, group_ids=torch.tensor(gids))
    await store.end_stream()
    await asyncio.wait_for(stage.run(), 60)  # a hang guard, not a timing
    meta = await store.get_meta("reader", (C.GROUP_ID, C.RESPONSE_IDS), ROWS, partial=True, timeout=0)
    batch = await store.get(meta)
    resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
    return engine, {int(g): resp[i].tolist() for i, g in enumerate(batch[C.GROUP_ID].tolist())}


def test_a_burst_of_results_sends_the_freed_slots_requests_in_one_call():
    engine, written = asyncio.run(_run())
    # a lease fills the slots in one call; the burst of its aborted results re-sends the resumed requests in one
    # call (before: one call per result), and so on for each lease
    assert [len(c) for c in engine.calls] == [SLOTS] * (2 * ROWS // SLOTS)
    assert sorted(rid for c in engine.calls for rid in c) == sorted(f"row{i}-try{t}" for i in range(ROWS)
                                                                      for t in (0, 1))
    assert len(written) == ROWS and all(ids == [1, 2] for ids in written.values())


def test_requests_taken_back_before_the_send_are_not_sent():
    """A request re-queued between its assignment and the send (its replica died, or it was released) stays
    out of the call; one for a replica whose engine was replaced meanwhile is not sent to the new engine."""

    async def body() -> BurstEngine:
        engine = SilentEngine()
        stage, _ = _stage(engine, InProcessStore(capacity=8))
        r = stage.replicas[0]
        kept, released, *old = [SingleTurn(i, None, (7,), i) for i in range(4)]
        for q in (kept, released):
            stage.pool.assign(r, q.request_id, q)
        stage._send(r, [kept, released])
        stage.pool.release(r, released.request_id)
        await asyncio.sleep(0)  # the send: one call, without the released request
        await asyncio.sleep(0)
        for q in old:
            stage.pool.assign(r, q.request_id, q)
        stage._send(r, old)
        r.generation += 1  # replaced before the send (mark_dead bumps it and re-queues what was in flight)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for t in list(stage._tasks):
            t.cancel()
        return engine

    engine = asyncio.run(body())
    assert engine.calls == [["row0-try0"]]
