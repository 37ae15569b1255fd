"""What this engine promises beyond the spec suite's generic checks, with a model of its own choosing.

Keep tests like these next to the conformance module: they pin down your
engine's own behaviour with its real model (here a tiny Qwen2 built from an
``hf_config``, the way a run config describes a model).
"""

import asyncio

import pytest
import torch

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import PauseMode
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, pack_buckets
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_plugins.hf.model import build_causal_lm

TINY = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
        "tie_word_embeddings": True}
OPTIONS = {"model": {"hf_config": TINY}, "device": "cpu"}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def started(**overrides):
    engine = get_plugin_manager().create("rollout_engine", "myengine", {**OPTIONS, **overrides})
    await engine.start()
    return engine


async def complete(engine, *requests):
    return {r.request_id: r async for r in engine.generate(list(requests))}


def request(rid, n=6, **sampling):
    return GenerationRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=n, **sampling))


def reference(seed):
    """The policy as the trainers build it: the same builder, so seed 0 is the engine's version 0."""
    return build_causal_lm(ModelConfig(hf_config=TINY), seed=seed)


def exported(model):
    """The tensors as the fsdp trainer exports them: state_dict names, the tied lm_head sent once."""
    return [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]


def buckets_of(model, version, bucket_bytes=1 << 12):
    return pack_buckets(exported(model), version=version, bucket_bytes=bucket_bytes)


async def aiter_(items):
    for item in items:
        yield item


def test_logprobs_are_the_models_own_under_the_sampling_convention():
    """Re-scoring the sampled tokens with the trainer-built weights gives the returned log-probs."""

    async def body():
        engine = await started()
        try:
            return (await complete(engine, request("a", n=10, temperature=0.7, top_k=5)))["a"]
        finally:
            await engine.shutdown()

    res = run(body())
    tokens = torch.tensor([[1, 2, 3, *res.token_ids]])
    with torch.no_grad():
        logits = reference(0)(input_ids=tokens).logits[0, 2:-1]  # the logits that sampled each generated token
    want = sampling_logprobs(logits, 0.7, 1.0, 5).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)


def test_update_weights_takes_the_trainer_names_and_refuses_bad_buckets():
    """A complete, verified version in the trainer's names is applied; a corrupted or incomplete one is refused."""

    async def body():
        engine = await started()
        other = reference(7)
        try:
            before = (await complete(engine, request("b", seed=3)))["b"]
            good = list(buckets_of(other, version=1))
            assert len(good) > 1  # several buckets: the engine assembles a version from parts
            bad = list(buckets_of(other, version=2))
            bad[0].buffer[0] ^= 1  # corrupt one byte
            with pytest.raises(WeightTransferError, match="corrupted"):
                await engine.update_weights(2, aiter_(bad))
            with pytest.raises(WeightTransferError, match="ended before its last bucket"):
                await engine.update_weights(2, aiter_(list(buckets_of(other, version=2))[:1]))
            assert engine.version == 0
            again = (await complete(engine, request("b", seed=3)))["b"]
            assert again.token_ids == before.token_ids  # per-request seed: same weights, same tokens
            await engine.update_weights(1, aiter_(good))
            after = (await complete(engine, request("b", seed=3)))["b"]
            assert engine.version == 1 and set(after.versions) == {1}
            return after
        finally:
            await engine.shutdown()

    after = run(body())
    tokens = torch.tensor([[1, 2, 3, *after.token_ids]])
    with torch.no_grad():
        logits = reference(7)(input_ids=tokens).logits[0, 2:-1]
    want = sampling_logprobs(logits, 1.0).gather(1, torch.tensor(after.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(after.logprobs), want, atol=1e-4, rtol=0)


def test_prefix_is_continued_and_returned():
    """A request carrying an aborted attempt's tokens continues after them and returns them first."""

    async def body():
        engine = await started()
        try:
            first = (await complete(engine, request("p", n=3)))["p"]
            resumed = GenerationRequest("p2", (1, 2, 3), SamplingParams(max_new_tokens=5),
                                        prefix_token_ids=tuple(first.token_ids), prefix_logprobs=tuple(first.logprobs),
                                        prefix_versions=tuple(first.versions))
            res = (await complete(engine, resumed))["p2"]
            assert tuple(res.token_ids[:3]) == tuple(first.token_ids) and len(res.token_ids) == 5
            assert res.finish_reason is FinishReason.LENGTH
        finally:
            await engine.shutdown()

    run(body())


def test_pause_abort_hands_back_partials_and_holds_new_requests():
    """pause(ABORT) ends in-flight requests with their tokens; requests sent while paused start after resume."""

    async def body():
        engine = await started()
        try:
            running = asyncio.ensure_future(complete(engine, request("x", n=10_000)))
            await asyncio.sleep(0)
            await engine.pause(PauseMode.ABORT)
            res = (await running)["x"]
            assert res.finish_reason is FinishReason.ABORT and len(res.token_ids) < 10_000
            waiting = asyncio.ensure_future(complete(engine, request("y", n=2)))
            await asyncio.sleep(0)
            assert not waiting.done() and (await engine.health()).in_flight == 0
            await engine.resume()
            assert (await waiting)["y"].finish_reason is FinishReason.LENGTH
        finally:
            await engine.shutdown()

    run(body())
