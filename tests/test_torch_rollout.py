"""The ``torch`` rollout engine: the conformance suite plus the behaviour it promises beyond it.

The oracle for log-probs is an independent full forward pass over prompt +
completion (teacher forcing) scored with the trainer's convention,
``sampling_logprobs``.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError, EngineError, WeightTransferError
from asyncflow_core.interfaces import KVCachePolicy, PauseMode
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, pack_buckets
from asyncflow_plugins.hf.model import build_causal_lm
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_spec import RolloutEngineSpec
from asyncflow_spec.base import run
from tolerances import forward_terms, logprob_tol

TINY = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 48,
    "max_position_embeddings": 512,
}
MODEL = {"hf_config": TINY}
BASE = {"model": MODEL, "device": "cpu", "eos_token_ids": []}


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """A tiny model is fastest on one thread; several oversubscribe a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TestTorchRolloutSpec(RolloutEngineSpec):
    backend = "torch"
    options = BASE

    def weights(self):
        return dict(reference(init_seed=1).state_dict())


def make(**overrides):
    return get_plugin_manager().create("rollout_engine", "torch", {**BASE, **overrides})


async def started(**overrides):
    engine = make(**overrides)
    await engine.start()
    return engine


def reference(init_seed: int = 0, hf: dict | None = None) -> torch.nn.Module:
    return build_causal_lm(ModelConfig(hf_config=hf or TINY), seed=init_seed)


@torch.no_grad()
def teacher_forced(net, prompt, tokens, sampling: SamplingParams) -> torch.Tensor:
    """Log-probs of ``tokens`` from one full forward pass over prompt + tokens, in the sampling convention."""
    tokens = [int(t) for t in tokens]
    logits = net(input_ids=torch.tensor([[*prompt, *tokens]])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    logp = sampling_logprobs(rows, sampling.temperature, sampling.top_p, sampling.top_k)
    return logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def assert_teacher_forced(net, result, sampling, *, start: int = 0, stop: int | None = None) -> None:
    """The engine's log-probs (incremental decoding, its own order of additions) equal one full forward's."""
    full = result.prompt_token_ids, list(result.token_ids)
    expected = teacher_forced(net, *full, sampling)[start:stop]
    got = torch.tensor(list(result.logprobs), dtype=torch.float32)[start:stop]
    assert torch.isfinite(got).all()
    terms = forward_terms(net.config.to_dict(), row_length=len(full[0]) + len(full[1]))
    torch.testing.assert_close(got, expected, atol=logprob_tol(expected, terms), rtol=0)


def request(rid, prompt=(1, 2, 3), **sampling) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), SamplingParams(**{"max_new_tokens": 16, **sampling}))


async def collect(stream):
    return [r async for r in stream]


def background(engine, reqs):
    """Run ``engine.generate(reqs)`` to completion in a task (its list of results)."""
    return asyncio.ensure_future(collect(engine.generate(reqs)))


# -- log-probs, batching, resume --------------------------------------------


def test_logprobs_match_a_full_forward_under_temperature_top_p_top_k():
    """Rows of different lengths join a small running batch mid-way; every log-prob still matches teacher forcing."""
    sampling = {"temperature": 0.7, "top_p": 0.85, "top_k": 20, "max_new_tokens": 12}
    net = reference()

    async def body():
        engine = await started(max_batch=3)
        try:
            reqs = [request(f"r{i}", prompt=range(1, 2 + 3 * i % 11), **sampling) for i in range(8)]
            reqs.append(request("hot", prompt=(4, 5), temperature=1.7, max_new_tokens=9))
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body())
    assert len(results) == 9
    for res in results:
        params = SamplingParams(temperature=1.7) if res.request_id == "hot" else SamplingParams(**sampling)
        assert res.finish_reason is FinishReason.LENGTH
        assert_teacher_forced(net, res, params)


def test_samples_of_one_prompt_share_one_prefill_row_and_keep_their_own_log_probs():
    """A group's n samples of one prompt prefill as one row (their cache rows copied), and each still samples on
    its own: every log-prob matches teacher forcing, and the samples are not all alike."""
    sampling = {"temperature": 1.0, "max_new_tokens": 8}
    net = reference()
    widths: list[int] = []

    async def body():
        engine = await started(max_batch=16)
        forward = engine._forward

        def spy(ids, mask, positions, cache):
            if cache.get_seq_length() == 0:  # a prefill (decode steps carry the cache)
                widths.append(ids.shape[0])
            return forward(ids, mask, positions, cache)

        engine._forward = spy
        try:
            reqs = [request(f"a{i}", prompt=(5, 6, 7), **sampling) for i in range(8)]
            reqs += [request(f"b{i}", prompt=(9, 1), **sampling) for i in range(4)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body())
    assert widths == [2]  # 12 requests, 2 distinct prompts: one prefill of 2 rows
    assert len({tuple(r.token_ids) for r in results if r.request_id.startswith("a")}) > 1
    for res in results:
        assert_teacher_forced(net, res, SamplingParams(**sampling))


def test_resume_from_prefix_continues_after_it():
    """A request carrying an aborted attempt's tokens returns them and continues on the same distribution."""
    net = reference()
    sampling = SamplingParams(max_new_tokens=10, temperature=0.9)

    async def body():
        engine = await started()
        try:
            (first,) = await collect(engine.generate([GenerationRequest("a", (3, 1, 4), sampling)]))
            prefix = dataclasses.replace(
                GenerationRequest("b", (3, 1, 4), sampling),
                prefix_token_ids=tuple(first.token_ids[:4]),
                prefix_logprobs=tuple(first.logprobs[:4]),
                prefix_versions=(7, 7, 7, 7),
            )
            (resumed,) = await collect(engine.generate([prefix]))
            return first, resumed
        finally:
            await engine.shutdown()

    first, resumed = run(body())
    assert len(resumed.token_ids) == 10
    assert tuple(resumed.token_ids[:4]) == tuple(first.token_ids[:4])
    assert tuple(resumed.versions) == (7, 7, 7, 7, 0, 0, 0, 0, 0, 0)
    assert_teacher_forced(net, resumed, sampling)


def test_same_seed_same_completions():
    async def body(seed, per_request=None):
        engine = await started(seed=seed)
        try:
            reqs = [request(f"s{i}", prompt=(1 + i,), seed=per_request) for i in range(6)]
            results = await collect(engine.generate(reqs))
            return {r.request_id: tuple(r.token_ids) for r in results}
        finally:
            await engine.shutdown()

    assert run(body(3)) == run(body(3))
    assert run(body(3)) != run(body(4))
    # a request's own seed decides its tokens, whatever the engine's seed
    assert run(body(3, per_request=11)) == run(body(4, per_request=11))


# -- stop tokens ------------------------------------------------------------


def test_stop_tokens_end_completions_and_are_included():
    """The config's eos (default) and a request's stop ids end a completion with reason stop."""
    hf = {**TINY, "eos_token_id": 5}

    async def body(**overrides):
        engine = await started(model={"hf_config": hf}, **overrides)
        try:
            reqs = [request(f"e{i}", prompt=(1 + i,), max_new_tokens=150, stop_token_ids=(7,)) for i in range(12)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body(eos_token_ids=[5]))
    stops = [r for r in results if r.finish_reason is FinishReason.STOP]
    assert stops, "with ~2 stop ids in 48 and 150 tokens, some completion must stop"
    ends = set()
    for r in results:
        toks = list(r.token_ids)
        assert not {5, 7} & set(toks[:-1]), "no stop token may appear before the end"
        if r.finish_reason is FinishReason.STOP:
            ends.add(toks[-1])
        else:
            assert r.finish_reason is FinishReason.LENGTH and len(toks) == 150
    assert ends <= {5, 7}
    # an empty list (the default) ends nothing by itself; the request's stop id still works
    for r in run(body(eos_token_ids=[])):
        toks = list(r.token_ids)
        assert 7 not in toks[:-1]
        assert r.finish_reason is (FinishReason.STOP if toks[-1] == 7 else FinishReason.LENGTH)


def test_resumed_prefix_that_is_already_complete_finishes_at_once():
    async def body():
        engine = await started(eos_token_ids=[9])
        try:
            done = GenerationRequest("done", (1,), SamplingParams(max_new_tokens=5), (2, 9), (-1.0, -1.0), (0, 0))
            full = GenerationRequest("full", (1,), SamplingParams(max_new_tokens=2), (2, 3), (-1.0, -1.0), (0, 0))
            return {r.request_id: r for r in await collect(engine.generate([done, full]))}
        finally:
            await engine.shutdown()

    results = run(body())
    assert results["done"].finish_reason is FinishReason.STOP and tuple(results["done"].token_ids) == (2, 9)
    assert results["full"].finish_reason is FinishReason.LENGTH and tuple(results["full"].token_ids) == (2, 3)


# -- abort, pause, cancellation -----------------------------------------------


def test_abort_returns_the_partial_completion():
    """When a 3-token request finishes, the long one beside it has 3 tokens too; abort hands them back."""
    net = reference()
    long_sampling = SamplingParams(max_new_tokens=400, temperature=0.8)

    async def body():
        engine = await started()
        try:
            reqs = [request("short", max_new_tokens=3), GenerationRequest("long", (1, 2, 3), long_sampling)]
            stream = engine.generate(reqs)
            first = await stream.__anext__()
            assert first.request_id == "short"
            assert await engine.abort(["long", "unknown"]) == ["long"]
            rest = [r async for r in stream]
            health = await engine.health()
            return rest, health
        finally:
            await engine.shutdown()

    (partial,), health = run(body())
    assert partial.finish_reason is FinishReason.ABORT
    assert 3 <= len(partial.token_ids) < 400
    assert set(partial.versions) == {0}
    assert_teacher_forced(net, partial, long_sampling)
    assert health.ok and health.in_flight == 0


def test_pause_abort_holds_new_requests_until_resume():
    async def body():
        engine = await started()
        try:
            task = background(engine, [request(f"p{i}", max_new_tokens=400) for i in range(3)])
            await asyncio.sleep(0)
            await engine.pause(PauseMode.ABORT)
            aborted = await task
            held = background(engine, [request("later", max_new_tokens=4)])
            for _ in range(20):
                await asyncio.sleep(0)
            assert not held.done(), "a request submitted while paused must wait for resume"
            await engine.resume()
            return aborted, await held
        finally:
            await engine.shutdown()

    aborted, (later,) = run(body())
    assert {r.finish_reason for r in aborted} == {FinishReason.ABORT}
    assert later.finish_reason is FinishReason.LENGTH and len(later.token_ids) == 4


def test_pause_wait_lets_in_flight_requests_finish():
    async def body():
        engine = await started()
        try:
            task = background(engine, [request(f"w{i}", max_new_tokens=20) for i in range(3)])
            await asyncio.sleep(0)
            await engine.pause(PauseMode.WAIT)
            assert (await engine.health()).in_flight == 0, "pause(WAIT) returns once the in-flight requests finished"
            await engine.resume()
            return await task
        finally:
            await engine.shutdown()

    assert {r.finish_reason for r in run(body())} == {FinishReason.LENGTH}


def test_abort_while_paused_with_keep_hands_back_the_held_requests():
    async def body():
        engine = await started()
        try:
            task = background(engine, [request(f"k{i}", max_new_tokens=400) for i in range(2)])
            await asyncio.sleep(0)
            await engine.pause(PauseMode.KEEP)
            assert sorted(await engine.abort(None)) == ["k0", "k1"]
            results = await task
            await engine.resume()
            return results
        finally:
            await engine.shutdown()

    assert {r.finish_reason for r in run(body())} == {FinishReason.ABORT}


def test_an_engine_failure_ends_every_stream_with_the_reason():
    async def body():
        engine = await started()

        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        engine._forward = broken
        with pytest.raises(EngineError, match="device lost"):
            await collect(engine.generate([request("x")]))
        health = await engine.health()
        with pytest.raises(EngineError, match="device lost"):
            await collect(engine.generate([request("y")]))
        await engine.shutdown()
        return health

    health = run(body())
    assert not health.ok and "device lost" in health.detail


def test_a_consumer_leaving_early_does_not_disturb_others():
    async def body():
        engine = await started(max_batch=8)
        try:
            other = background(engine, [request(f"o{i}", max_new_tokens=30) for i in range(4)])
            stream = engine.generate([request("quick", max_new_tokens=2), request("slow", max_new_tokens=300)])
            await stream.__anext__()
            await stream.aclose()  # "slow" is still decoding: the engine drops it
            results = await other
            health = await engine.health()
            return results, health
        finally:
            await engine.shutdown()

    results, health = run(body())
    assert sorted(r.request_id for r in results) == [f"o{i}" for i in range(4)]
    assert health.in_flight == 0


def test_many_concurrent_generate_calls():
    """Five callers, 60 requests, a running batch of 16: every request comes back once, to its caller."""

    async def body():
        engine = await started(max_batch=16)
        try:
            calls = [
                [request(f"c{c}-{i}", prompt=range(1, 2 + (i + c) % 6), max_new_tokens=4 + (i % 7)) for i in range(12)]
                for c in range(5)
            ]
            return calls, await asyncio.gather(*(collect(engine.generate(reqs)) for reqs in calls))
        finally:
            await engine.shutdown()

    calls, outputs = run(body())
    for reqs, results in zip(calls, outputs, strict=True):
        assert sorted(r.request_id for r in results) == sorted(q.request_id for q in reqs)
        by_id = {q.request_id: q for q in reqs}
        for r in results:
            assert len(r.token_ids) == by_id[r.request_id].sampling.max_new_tokens == len(r.logprobs)


# -- weights ----------------------------------------------------------------


def buckets_of(net, version, *, bucket_bytes=4096, rename=None, drop=None, edit=None):
    items = []
    for name, tensor in net.state_dict().items():
        if name == drop:
            continue
        if edit is not None and name == edit[0]:
            tensor = edit[1](tensor)
        items.append(((rename or {}).get(name, name), tensor))
    return list(pack_buckets(items, version=version, bucket_bytes=bucket_bytes))


async def feed(buckets):
    for b in buckets:
        yield b


def test_weight_update_switches_the_policy():
    old_net, new_net = reference(0), reference(1)
    sampling = SamplingParams(max_new_tokens=10, temperature=0.8)

    async def body():
        engine = await started()
        try:
            await engine.update_weights(1, feed(buckets_of(new_net, 1)))
            assert engine.version == 1
            return await collect(engine.generate([GenerationRequest("n", (1, 2), sampling)]))
        finally:
            await engine.shutdown()

    (res,) = run(body())
    assert set(res.versions) == {1}
    assert_teacher_forced(new_net, res, sampling)
    old = teacher_forced(old_net, res.prompt_token_ids, res.token_ids, sampling)
    assert not torch.allclose(old, torch.tensor(list(res.logprobs)), atol=1e-3)


def test_bad_weight_updates_are_refused_and_change_nothing():
    new_net = reference(1)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = {
        "unknown name": buckets_of(new_net, 1, rename={name: "model.layers.9.nope.weight"}),
        "shape": buckets_of(new_net, 1, edit=(name, lambda t: t[:-1].contiguous())),
        "dtype": buckets_of(new_net, 1, edit=(name, lambda t: t.double())),
        "missing": buckets_of(new_net, 1, drop=name),
        "version": buckets_of(new_net, 2),
        "empty": [],
    }
    corrupt = buckets_of(new_net, 1)
    corrupt[-1].buffer[0] ^= 0xFF
    bad["checksum"] = corrupt

    async def body():
        engine = await started()
        try:
            before = {k: v.clone() for k, v in engine._net.state_dict().items()}
            messages = {}
            for what, buckets in bad.items():
                with pytest.raises(WeightTransferError) as info:
                    await engine.update_weights(1, feed(buckets))
                messages[what] = str(info.value)
                assert engine.version == 0
            after = engine._net.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), "a refused update changed weights"
            return messages
        finally:
            await engine.shutdown()

    messages = run(body())
    assert "not a tensor of this model" in messages["unknown name"]
    assert "shape" in messages["shape"] and "dtype" in messages["dtype"]
    assert name in messages["missing"] and "version 2" in messages["version"]
    assert "corrupted" in messages["checksum"] and "no weight buckets" in messages["empty"]


@pytest.mark.parametrize("policy", [KVCachePolicy.RECOMPUTE, KVCachePolicy.KEEP])
def test_update_while_paused_with_held_requests(policy):
    """pause(KEEP) → update → resume: later tokens carry the new version; RECOMPUTE makes them exactly on-policy."""
    old_net, new_net = reference(0), reference(1)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.9)

    async def body():
        engine = await started()
        try:
            reqs = [request("short", max_new_tokens=4), GenerationRequest("held", (2, 3, 4), sampling)]
            stream = engine.generate(reqs)
            await stream.__anext__()
            await engine.pause(PauseMode.KEEP)
            await engine.update_weights(1, feed(buckets_of(new_net, 1)), kv_cache=policy)
            await engine.resume()
            return [r async for r in stream]
        finally:
            await engine.shutdown()

    (res,) = run(body())
    versions = list(res.versions)
    switch = versions.index(1)
    assert versions == [0] * switch + [1] * (len(versions) - switch) and switch >= 4
    assert_teacher_forced(old_net, res, sampling, stop=switch)
    if policy is KVCachePolicy.RECOMPUTE:
        assert_teacher_forced(new_net, res, sampling, start=switch)


# -- bad input ------------------------------------------------------------------


def test_configuration_mistakes_are_clear_errors():
    pm = get_plugin_manager()
    with pytest.raises(ConfigError, match="needs a model"):
        pm.create("rollout_engine", "torch", {"device": "cpu"})
    with pytest.raises(ConfigError):
        pm.create("rollout_engine", "torch", {**BASE, "max_batc": 3})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            pm.create("rollout_engine", "torch", {**BASE, "device": "cuda"})

    async def bad_eos():
        engine = make(eos_token_ids=[48])
        with pytest.raises(ConfigError, match="outside the model's vocabulary"):
            await engine.start()

    run(bad_eos())


def test_bad_requests_fail_alone():
    async def body():
        engine = await started()
        try:
            reqs = [request("ok"), request("oov", prompt=(1, 99)), request("long", prompt=(1,) * 512)]
            return {r.request_id: r for r in await collect(engine.generate(reqs))}
        finally:
            await engine.shutdown()

    results = run(body())
    assert results["ok"].finish_reason is FinishReason.LENGTH
    assert results["oov"].finish_reason is FinishReason.ERROR and "vocabulary" in results["oov"].error
    assert results["long"].finish_reason is FinishReason.ERROR and "max_position_embeddings" in results["long"].error


def test_decoding_uses_the_thread_count_the_engine_started_with():
    """torch's intra-op thread count is per thread once a thread has computed (OpenMP), so a worker thread that
    ran torch before keeps its count; the engine decodes with the count its start saw (what a trainer sharing the
    host left, or ``torch_threads``), whatever the worker had."""
    import threading

    seen: list[int] = []

    async def body():
        engine = await started(max_batch=4)
        step = engine._step

        def recording(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return step(*args, **kwargs)

        engine._step = recording
        try:
            def spoil():  # the executor's threads have computed with 2 threads before the engine decodes on them
                torch.set_num_threads(2)
                torch.ones(64).sum()
            await asyncio.gather(*(asyncio.to_thread(spoil) for _ in range(4)))
            torch.set_num_threads(1)  # the calling thread, as the module fixture left it
            return await collect(engine.generate([request(f"r{i}", max_new_tokens=3) for i in range(4)]))
        finally:
            await engine.shutdown()

    results = run(body())
    assert len(results) == 4 and seen and set(seen) == {1}, seen
    assert threading.current_thread() is threading.main_thread()
