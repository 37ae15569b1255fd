"""LoRA adapter updates on vLLM's CUDA path (punica's Triton kernels), run for real on CUDA (``make test-gpu``).

Written against vLLM 0.32.0 by reading its source (``vllm/lora``: ``WorkerLoRAManager.add_adapter`` with
``load_inplace``, ``PunicaWrapperGPU``); not run yet (no GPU where it was written), so a failure may be the
test's as well as the adapter's. One GPU. The model computes in bfloat16 (vLLM's LoRA kernels take
float16/bfloat16), so the engine is compared with the trainer by the mean log-prob difference per token,
against the same figure for the previous adapter: the adapter in force must be the one sent.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tests run in .venv-vllm: make test-vllm)")
pytest.importorskip("peft", reason="peft is not installed")

from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import GenerationRequest, SamplingParams, pack_buckets  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402

GPU_QWEN2 = {
    "model_type": "qwen2", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "initializer_range": 0.2, "eos_token_id": 63,
}
SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"))
#: bfloat16 rounds to 2^-8 relative: a tiny two-layer model's log-probs agree to a few 1e-2 per token at most
BF16_MEAN = 0.05


def trainer(seed: int):
    model = wrap(build_causal_lm(ModelConfig(hf_config=GPU_QWEN2, dtype="bfloat16")).float(), SPEC)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


async def feed(buckets):
    for b in buckets:
        yield b


@torch.no_grad()
def mean_dlogp(model, results, sp) -> float:
    diffs = []
    for res in results:
        tokens = list(res.token_ids)
        ids = torch.tensor([[*res.prompt_token_ids, *tokens]])
        logits = model(input_ids=ids).logits[0, len(res.prompt_token_ids) - 1: -1].float()
        lp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k).gather(1, torch.tensor(tokens)[:, None])
        diffs.append((lp[:, 0] - torch.tensor(res.logprobs)).abs())
    return float(torch.cat(diffs).mean())


@pytest.mark.gpu
def test_adapter_versions_reach_vllm_on_cuda():
    async def body():
        eng = get_plugin_manager().create("rollout_engine", "vllm", {
            "model": {"hf_config": GPU_QWEN2, "dtype": "bfloat16"}, "device": "cuda", "max_model_len": 256,
            "max_num_seqs": 16, "gpu_memory_utilization": 0.3, "enforce_eager": True, "eos_token_ids": []})
        eng.configure_adapter(SPEC)
        await eng.start()
        try:
            for version, seed in ((1, 11), (2, 12)):
                model = trainer(seed)
                state = adapter_state_dict(model).items()
                await eng.update_weights(version, feed(list(pack_buckets(state, version=version,
                                                                          bucket_bytes=1 << 20))))
                sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
                reqs = [GenerationRequest(f"v{version}-{i}", (1 + i, 2, 3), sp) for i in range(4)]
                results = [r async for r in eng.generate(reqs)]
                assert all(set(r.versions) == {version} for r in results)
                now, before = mean_dlogp(model, results, sp), mean_dlogp(trainer(seed - 1), results, sp)
                assert now < BF16_MEAN and before > 5 * now, (now, before)
        finally:
            await eng.shutdown()

    asyncio.run(body())
