"""The sim rollout engine and ``SamplingParams.seed``: a seeded request is a pure function of its seed and prompt."""

from __future__ import annotations

import asyncio

from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams
from asyncflow_plugins.sim.rollout import SimRolloutConfig, SimRolloutEngine

FAST = {"time_scale": 1e-3}


def _generate(requests: list[GenerationRequest], **options) -> dict[str, object]:
    async def body():
        engine = SimRolloutEngine(SimRolloutConfig(**{**FAST, **options}))
        await engine.start()
        try:
            return {r.request_id: r async for r in engine.generate(requests)}
        finally:
            await engine.shutdown()

    return asyncio.run(body())


def _req(rid: str, prompt: tuple[int, ...] = (1, 2, 3), seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=64, seed=seed))


def _tokens(result) -> list[int]:
    return result.token_ids.tolist()


def test_one_seed_and_prompt_give_one_completion_whatever_the_request_id():
    out = _generate([_req("a", seed=7), _req("b", seed=7), _req("c", seed=8), _req("d"), _req("e")])
    assert _tokens(out["a"]) == _tokens(out["b"]) and len(out["a"].token_ids) > 0
    assert _tokens(out["a"]) != _tokens(out["c"])  # another seed, another draw
    assert _tokens(out["d"]) != _tokens(out["e"])  # unseeded requests still draw from their ids


def test_a_seed_with_another_prompt_is_another_draw():
    out = _generate([_req("a", (1, 2, 3), seed=7), _req("b", (1, 2, 4), seed=7)])
    assert _tokens(out["a"]) != _tokens(out["b"])


def test_lengths_only_results_keep_the_seeded_length():
    full = _generate([_req("a", seed=7)])["a"]
    short = _generate([_req("z", seed=7)], payload="lengths")["z"]
    assert short.token_ids.shape == (len(full.token_ids), 0)
    assert short.versions.tolist() == full.versions.tolist()


def test_a_prompt_token_outside_the_vocabulary_is_that_requests_error():
    out = _generate([_req("good"), _req("bad", (1, 99))], vocab_size=50)
    assert out["good"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert out["bad"].finish_reason is FinishReason.ERROR and "outside the vocabulary" in out["bad"].error
