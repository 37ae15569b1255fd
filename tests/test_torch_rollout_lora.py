"""LoRA adapter updates in the ``torch`` rollout engine, merged into the weights and as live peft layers.

The oracle is the trainer's model: ``peft``'s LoRA (``asyncflow_core.types.adapter.wrap``) on the same
base weights, scoring the engine's completion by teacher forcing in the sampling convention. Each
version's adapter is a fresh random draw, far from the previous one, so an engine that skipped a
version, accumulated merges, or kept the base model fails the comparison (each test also checks that
the wrong answer is far off, so the comparison can fail).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import ConfigError, WeightTransferError  # noqa: E402
from asyncflow_core.interfaces import KVCachePolicy, PauseMode  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import GenerationRequest, SamplingParams, pack_buckets  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402
from tolerances import forward_terms, logprob_tol  # noqa: E402

TINY = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 48,
    "max_position_embeddings": 512,
}
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), modules_to_save=("lm_head",))
MODES = ["merged", "live"]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine(mode: str, spec: LoraSpec | None = SPEC):
    eng = get_plugin_manager().create("rollout_engine", "torch",
                                      {"model": {"hf_config": TINY}, "device": "cpu", "lora_mode": mode})
    if spec is not None:
        eng.configure_adapter(spec)
    return eng


def trainer(seed: int, spec: LoraSpec = SPEC):
    """The trainer's peft model on the base weights (init seed 0) with a random adapter drawn from ``seed``."""
    model = wrap(build_causal_lm(ModelConfig(hf_config=TINY)), spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


async def feed(buckets):
    for b in buckets:
        yield b


def adapter_update(model, version: int):
    return feed(list(pack_buckets(adapter_state_dict(model).items(), version=version, bucket_bytes=2 << 10)))


async def sample(eng, tag: str, n: int = 3, tokens: int = 10):
    sp = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=5)
    reqs = [GenerationRequest(f"{tag}-{i}", (1 + i, 2, 3), sp) for i in range(n)]
    return [r async for r in eng.generate(reqs)], sp


@torch.no_grad()
def gap(model, results, sp) -> tuple[float, float]:
    """The largest |engine - model| log-prob over the results, and the tolerance for it."""
    worst, tol = 0.0, 0.0
    for res in results:
        tokens = list(res.token_ids)
        ids = torch.tensor([[*res.prompt_token_ids, *tokens]])
        logits = model(input_ids=ids).logits[0, len(res.prompt_token_ids) - 1: -1].float()
        lp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k)
        lp = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(res.logprobs)).abs().max()))
        # merging rounds W0 + delta once more than the unmerged sum: a few extra terms per layer
        tol = max(tol, logprob_tol(lp, forward_terms(TINY, ids.shape[1]) + 4 * SPEC.rank))
    return worst, tol


@pytest.mark.parametrize("mode", MODES)
def test_every_adapter_version_is_the_policy_never_an_accumulation(mode):
    async def body():
        eng = engine(mode)
        await eng.start()
        try:
            for version, seed in ((1, 11), (2, 12), (3, 13)):
                model = trainer(seed)
                await eng.update_weights(version, adapter_update(model, version))
                assert eng.version == version
                results, sp = await sample(eng, f"v{version}")
                assert all(set(r.versions) == {version} for r in results)
                worst, tol = gap(model, results, sp)
                assert worst <= tol, (version, worst, tol)
                stale, _ = gap(trainer(seed - 1), results, sp)  # the previous version: what a skipped sync shows
                assert stale > 100 * tol
        finally:
            await eng.shutdown()

    asyncio.run(body())


@pytest.mark.parametrize("mode", MODES)
def test_a_full_update_without_adapter_tensors_is_the_base_model_alone(mode):
    async def body():
        eng = engine(mode)
        await eng.start()
        try:
            await eng.update_weights(1, adapter_update(trainer(21), 1))
            base = build_causal_lm(ModelConfig(hf_config=TINY), seed=3)  # other base weights
            await eng.update_weights(2, feed(list(pack_buckets(base.state_dict().items(), version=2,
                                                                 bucket_bytes=16 << 10))))
            results, sp = await sample(eng, "base")
            worst, tol = gap(base, results, sp)
            assert worst <= tol
            # an adapter on the new base: W0 is the new base, not the old one
            model = wrap(build_causal_lm(ModelConfig(hf_config=TINY), seed=3), SPEC)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.fill_(0.05)
            await eng.update_weights(3, adapter_update(model, 3))
            results, sp = await sample(eng, "on-new-base")
            worst, tol = gap(model.eval(), results, sp)
            assert worst <= tol
        finally:
            await eng.shutdown()

    asyncio.run(body())


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_adapter_update_changes_neither_weights_nor_version(mode):
    async def body():
        eng = engine(mode)
        await eng.start()
        try:
            model = trainer(41)
            await eng.update_weights(1, adapter_update(model, 1))
            state = adapter_state_dict(trainer(42))
            name = next(n for n in state if "lora_A" in n)
            partial = [(n, t) for n, t in state.items() if n != name]
            with pytest.raises(WeightTransferError, match="left 1 of its"):
                await eng.update_weights(2, feed(list(pack_buckets(partial, version=2, bucket_bytes=2 << 10))))
            assert eng.version == 1
            results, sp = await sample(eng, "after-refusal")
            worst, tol = gap(model, results, sp)
            assert worst <= tol
        finally:
            await eng.shutdown()

    asyncio.run(body())


def test_a_request_held_across_an_adapter_update_carries_both_versions():
    async def body():
        eng = engine("merged")
        await eng.start()
        try:
            await eng.update_weights(1, adapter_update(trainer(51), 1))
            sp = SamplingParams(max_new_tokens=200, temperature=1.0, seed=9)
            stream = eng.generate([GenerationRequest("held", (1, 2, 3), sp)])
            task = asyncio.ensure_future(stream.__anext__())
            while "held" not in eng._active or not eng._active["held"].tokens:  # noqa: SLF001 - first tokens
                await asyncio.sleep(0.001)
            await eng.pause(PauseMode.KEEP)
            await eng.update_weights(2, adapter_update(trainer(52), 2), kv_cache=KVCachePolicy.RECOMPUTE)
            await eng.resume()
            res = await task
            versions = list(res.versions)
            assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
        finally:
            await eng.shutdown()

    asyncio.run(body())


def test_misuse_is_one_clear_line():
    async def body():
        eng = engine("merged", spec=None)
        await eng.start()
        try:
            # an adapter-only update to an engine that was not told about the adapter
            with pytest.raises(WeightTransferError, match="not a tensor of this model"):
                await eng.update_weights(1, adapter_update(trainer(61), 1))
            eng.configure_adapter(SPEC)  # after start, before any update: accepted
            await eng.update_weights(1, adapter_update(trainer(61), 1))
            with pytest.raises(ConfigError, match="already called"):
                eng.configure_adapter(LoraSpec(rank=2))
        finally:
            await eng.shutdown()
        late = engine("merged", spec=None)
        await late.start()
        try:
            base = build_causal_lm(ModelConfig(hf_config=TINY))
            await late.update_weights(1, feed(list(pack_buckets(base.state_dict().items(), version=1,
                                                                  bucket_bytes=16 << 10))))
            with pytest.raises(ConfigError, match="before the first weight update"):
                late.configure_adapter(SPEC)
            with pytest.raises(ConfigError, match="match no layer"):
                await engine("merged", LoraSpec(target_modules=("nope",))).start()
        finally:
            await late.shutdown()

    asyncio.run(body())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_adapter_updates_on_cuda_in_bfloat16(mode):
    """The CUDA path (fixed by reading torch 2.13 / peft 0.21, never run): W0 copies, B @ A and peft's layers on
    the GPU, the merge in float32 rounded once to bfloat16. Compared by the mean difference per token against
    the previous adapter's: the adapter in force must be the one sent."""
    async def body():
        eng = get_plugin_manager().create("rollout_engine", "torch", {
            "model": {"hf_config": TINY, "dtype": "bfloat16"}, "device": "cuda", "lora_mode": mode})
        eng.configure_adapter(SPEC)
        await eng.start()
        try:
            for version, seed in ((1, 71), (2, 72)):
                model = trainer(seed)
                await eng.update_weights(version, adapter_update(model, version))
                results, sp = await sample(eng, f"cuda-v{version}")
                assert all(set(r.versions) == {version} for r in results)
                now = _mean_gap(model, results, sp)
                before = _mean_gap(trainer(seed - 1), results, sp)
                assert now < 0.05 and before > 5 * now, (now, before)  # bfloat16 rounds to 2^-8 relative
        finally:
            await eng.shutdown()

    asyncio.run(body())


@torch.no_grad()
def _mean_gap(model, results, sp) -> float:
    diffs = []
    for res in results:
        tokens = list(res.token_ids)
        ids = torch.tensor([[*res.prompt_token_ids, *tokens]])
        logits = model(input_ids=ids).logits[0, len(res.prompt_token_ids) - 1: -1].float()
        lp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k).gather(1, torch.tensor(tokens)[:, None])
        diffs.append((lp[:, 0] - torch.tensor(res.logprobs)).abs())
    return float(torch.cat(diffs).mean())
