"""LoRA in the ``fsdp`` engine on CUDA: NCCL, bfloat16 compute (FSDP2 MixedPrecisionPolicy), frozen base.

Marked ``gpu`` (skipped without CUDA; ``make test-gpu`` runs them). Written
against torch 2.13's FSDP2 and peft 0.21 by reading their source, and never
run on a GPU by the project yet. What a first CUDA run checks: the mixed
precision policy casts frozen base and trainable adapter weights of one FSDP
unit alike (peft casts the adapter's input to the adapter's dtype), only the
adapter receives gradients and moves, the adapter update after a step is
exactly the adapter's tensors, and applied to the seed's base on the CPU in
float32 it scores the engine's tokens within bfloat16's error
(:func:`asyncflow_fsdp.testing.bf16_logprob_atol`; the adapter's own
roundings, at most as many per layer as the base's, are counted by doubling
the layers).

CI collects these through tests/test_lora_fsdp_gpu.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft (pip install 'asyncflow[lora]')")

from peft import set_peft_model_state_dict  # noqa: E402

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import Batch, RaggedTensor  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_fsdp.testing import TINY_QWEN2, bf16_logprob_atol, local_rank, tiny_options, train_payload  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402

VOCAB = TINY_QWEN2["vocab_size"]
LAYERS = TINY_QWEN2["num_hidden_layers"]
LORA = {"rank": 4, "alpha": 8}


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_options(world_size: int, **overrides) -> dict:
    return tiny_options(world_size=world_size, device="cuda", mixed_precision="bfloat16", lora=dict(LORA),
                        **overrides)


def sample_batch(rows: int = 7, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (2 + i % 4,), generator=gen) for i in range(rows)]
    responses = [torch.randint(0, VOCAB, (1 + (3 * i) % 5,), generator=gen) for i in range(rows)]
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
        C.RESPONSE_IDS: RaggedTensor.from_sequences(responses),
        C.REWARD: (torch.arange(rows) % 3 == 0).float(),
        C.GROUP_ID: torch.arange(rows) // 3,
    })


def cpu_oracle(batch: Batch, adapter: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """float32 log-probs on the CPU of the seed's base plus ``adapter``, and the logits' scale."""
    net = wrap(build_causal_lm(ModelConfig(hf_config=dict(TINY_QWEN2)), seed=0), LoraSpec(**LORA))
    set_peft_model_state_dict(net, {k: v.float().cpu() for k, v in adapter.items()})
    out, scale = [], 0.0
    with torch.no_grad():
        for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
            logits = net.eval()(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0].float()
            p = prompt.numel()
            picked = logits[p - 1: p - 1 + response.numel()]
            scale = max(scale, float(picked.abs().max()))
            out.append(sampling_logprobs(picked, 1.0).gather(1, response.unsqueeze(1)).squeeze(1))
    return torch.cat(out), scale


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_lora_step_on_cuda_sends_the_adapter_that_scores_as_the_engine(world):
    if gpus() < world:
        pytest.skip(f"needs {world} GPUs, {gpus()} visible")
    pm = get_plugin_manager()
    algo = pm.create("algorithm", "grpo", {})
    engine = pm.create("train_engine", "fsdp", cuda_options(world, micro_batch_tokens=16))
    batch = sample_batch()

    async def body():
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
            await engine.train_step(train, algo)
            update = {n: t.clone() async for b in engine.export_weights(bucket_bytes=1 << 20) for n, t in b.tensors()}
            return engine.info, (await engine.compute_logprobs(batch))[C.LOGPROBS], update
        finally:
            await engine.shutdown()

    info, after, update = asyncio.run(asyncio.wait_for(body(), 300))
    assert info["backend"] == "nccl"
    expected = adapter_state_dict(wrap(build_causal_lm(ModelConfig(hf_config=dict(TINY_QWEN2)), seed=0),
                                       LoraSpec(**LORA)))
    assert set(update) == set(expected)
    assert any(".lora_B." in n and bool(t.abs().max() > 0) for n, t in update.items())  # the step reached B
    want, scale = cpu_oracle(batch, update)
    atol = bf16_logprob_atol(scale, 2 * LAYERS)
    assert torch.allclose(after.values, want, rtol=0, atol=atol), (float((after.values - want).abs().max()), atol)


@pytest.mark.gpu
def test_frozen_base_is_bitwise_unchanged_on_cuda():
    """Under the bf16 mixed-precision policy only the adapter's float32 master shards move."""
    if gpus() < 1:
        pytest.skip("needs a GPU")
    algo = get_plugin_manager().create("algorithm", "grpo", {})
    batch = sample_batch()
    with local_rank(cuda_options(1), device="cuda") as worker:
        named = dict(worker.model.named_parameters())
        before = {n: p.to_local().detach().clone() for n, p in named.items()}
        logps, _ = worker.op_logprobs({"batch": batch, "micro_batches": [torch.arange(batch.num_rows)],
                                       "passes": 1, "values": False})
        behavior = RaggedTensor.from_sequences(logps, dtype=torch.float32)
        train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: behavior}))
        assert worker.op_train(train_payload(train, algo, 0))["stepped"]
        after = {n: p.to_local().detach() for n, p in worker.model.named_parameters()}
    for name, p in named.items():
        if p.requires_grad:
            assert ".lora_" in name
        else:
            assert torch.equal(after[name], before[name]), name
    assert any(p.requires_grad and not torch.equal(after[n], before[n]) for n, p in named.items())
