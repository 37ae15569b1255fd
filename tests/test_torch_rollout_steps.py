"""The ``torch`` engine's worker decodes step after step while the event loop wants nothing (``_steps``).

A return to the event loop between two decoding steps costs a thread hand-off
and waits for a free loop; in a run the loop is busy with the flow's stages.
So one worker call decodes on until something wants in. These tests pin what
that keeps: results of rows that finish on the way are delivered at once,
and a loop-side request (``_work`` set: new requests, abort, pause, a weight
swap) ends the call at the next step boundary, the safe point.
"""

from __future__ import annotations

from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams
from asyncflow_spec.base import run
from test_torch_rollout import _one_cpu_thread, assert_teacher_forced, reference, started  # noqa: F401 - fixture


def _counting(engine, *, interrupt_after: int | None = None) -> list[int]:
    """Wrap the engine's worker so each ``_steps`` call records how many ``_step`` calls it made.

    ``interrupt_after``: after that many steps of a call, set ``_work`` from the worker thread, standing in
    for the event loop asking in (no task waits on the event while the worker runs, so setting it is a flag).
    """
    per_call: list[int] = []
    step, steps = engine._step, engine._steps

    def counted_step(*args):
        out = step(*args)
        per_call[-1] += 1
        if interrupt_after is not None and per_call[-1] == interrupt_after and len(per_call) == 1:
            engine._work.set()
        return out

    def counted_steps(*args):
        per_call.append(0)
        return steps(*args)

    engine._step = counted_step
    engine._steps = counted_steps
    return per_call


def test_a_batch_decodes_to_the_end_in_one_worker_call_and_rows_are_delivered_as_they_finish():
    sampling = SamplingParams(max_new_tokens=8)

    async def body():
        engine = await started()
        per_call = _counting(engine)
        try:
            reqs = [GenerationRequest("long", (1, 2, 3), sampling),
                    GenerationRequest("short", (4, 5), SamplingParams(max_new_tokens=2))]
            results = [r async for r in engine.generate(reqs)]
            return results, per_call
        finally:
            await engine.shutdown()

    results, per_call = run(body())
    assert per_call == [8]  # one call, 8 steps: nothing on the loop's side wanted in
    assert [r.request_id for r in results] == ["short", "long"]  # short was handed over mid-call, first
    short, long = results
    assert len(short.token_ids) == 2 and len(long.token_ids) == 8
    assert long.finish_reason is FinishReason.LENGTH
    assert long.min_version == long.max_version == 0 == min(long.versions)
    assert_teacher_forced(reference(), long, sampling)


def test_the_worker_hands_the_batch_back_at_the_next_step_when_the_loop_wants_in():
    sampling = SamplingParams(max_new_tokens=6)

    async def body():
        engine = await started()
        per_call = _counting(engine, interrupt_after=2)
        try:
            (res,) = [r async for r in engine.generate([GenerationRequest("r", (1, 2, 3), sampling)])]
            return res, per_call
        finally:
            await engine.shutdown()

    res, per_call = run(body())
    assert per_call[0] == 2  # back to the loop right after the step that saw the request
    assert sum(per_call) == 6 and len(per_call) >= 2
    assert len(res.token_ids) == 6 and set(res.versions) == {0}
    assert_teacher_forced(reference(), res, sampling)


def test_an_abort_mid_call_returns_the_partial_completion_at_a_step_boundary():
    sampling = SamplingParams(max_new_tokens=400)

    async def body():
        engine = await started()
        try:
            stream = engine.generate([GenerationRequest("long", (1, 2, 3), sampling),
                                      GenerationRequest("short", (1, 2), SamplingParams(max_new_tokens=1))])
            first = await stream.__anext__()
            await engine.abort(["long"])
            rest = [r async for r in stream]
            return first, rest
        finally:
            await engine.shutdown()

    first, (partial,) = run(body())
    assert first.request_id == "short"
    assert partial.finish_reason is FinishReason.ABORT and 1 <= len(partial.token_ids) < 400
    assert_teacher_forced(reference(), partial, sampling)


def test_asyncio_event_set_from_the_worker_is_only_a_flag_here():
    """The interrupt the tests above simulate: nothing awaits ``_work`` while a worker call runs."""
    async def body():
        engine = await started()
        try:
            seen = []
            steps = engine._steps

            def probe(*args):
                seen.append(len(engine._work._waiters))
                return steps(*args)

            engine._steps = probe
            [r async for r in engine.generate([GenerationRequest("r", (1,), SamplingParams(max_new_tokens=2))])]
            return seen
        finally:
            await engine.shutdown()

    assert set(run(body())) == {0}
