"""The ``fsdp`` engine on CUDA: NCCL, one GPU per rank, bfloat16 compute (``mixed_precision: bfloat16``).

Every class here is marked ``gpu`` (skipped without CUDA; ``make test-gpu``
runs them). Written against torch 2.13's FSDP2 and never run on a GPU by the
project yet. Device and dtype are pinned (``device: cuda``,
``mixed_precision: bfloat16``), never ``auto``.

Tolerances come from bfloat16's unit roundoff u = 2**-8 (8 significant
bits): every stage of the forward (embedding, about ten per decoder layer:
projections, attention, activation, residual adds; the head) rounds its
output to bf16, a relative error of at most u each, so with k such stages a
logit carries at most k * u times the logits' scale, and a log-prob (logit
minus log-sum-exp of logits) twice that (``asyncflow_fsdp.testing.
bf16_logprob_atol``). The oracle is a float32 Hugging Face forward/backward
on the CPU in this process, on the same seed's weights.

CI collects these through tests/adapters/test_fsdp_gpu.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from asyncflow_spec import TrainEngineSpec

from asyncflow_core import columns as C
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import LossContext
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_fsdp.testing import TINY_QWEN2, bf16_logprob_atol, bf16_relative_error, tiny_options
from asyncflow_plugins.hf.model import build_causal_lm

VOCAB = TINY_QWEN2["vocab_size"]
LAYERS = TINY_QWEN2["num_hidden_layers"]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_options(world_size: int, **overrides) -> dict:
    return tiny_options(world_size=world_size, device="cuda", mixed_precision="bfloat16", **overrides)


def run(coro, timeout: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


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


def oracle(batch: Batch, behavior: RaggedTensor, algo) -> dict:
    """float32 HF on the CPU: per-token log-probs, the logits' scale, the step's loss and gradient norm."""
    net = build_causal_lm(ModelConfig(hf_config=dict(TINY_QWEN2)), seed=0).float().train()
    out, scale = [], 0.0
    for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
        logits = net(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0].float()
        p = prompt.numel()
        picked = logits[p - 1: p - 1 + response.numel()]
        scale = max(scale, float(picked.detach().abs().max()))
        out.append(sampling_logprobs(picked, 1.0, 1.0, -1).gather(1, response.unsqueeze(1)).squeeze(1))
    lp = torch.cat(out)
    resp = batch[C.RESPONSE_IDS]
    train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: behavior}))
    ctx = LossContext(global_tokens=resp.numel_packed, global_sequences=batch.num_rows, policy_version=0)
    loss, _ = algo.loss(RaggedTensor(lp, resp.offsets), train, ctx)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in net.parameters()))
    return {"logprobs": lp.detach(), "scale": scale, "loss": float(loss.detach()), "grad_norm": float(norm),
            "train": train}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
class TestFSDPOnCUDA:
    """Log-probs and one step against the float32 oracle, at world 1 and 2 (several micro-batches)."""

    @pytest.fixture
    def result(self, world):
        if gpus() < world:
            pytest.skip(f"needs {world} GPUs, {gpus()} visible")
        pm = get_plugin_manager()
        algo = pm.create("algorithm", "grpo", {})
        engine = pm.create("train_engine", "fsdp", cuda_options(world, micro_batch_tokens=16))

        async def body():
            await engine.setup()
            try:
                batch = sample_batch()
                lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
                want = oracle(batch, lp, algo)
                metrics = await engine.train_step(want["train"], algo)
                after = (await engine.compute_logprobs(batch))[C.LOGPROBS]
                return {"info": engine.info, "devices": engine.rank_devices, "logprobs": lp, "want": want,
                        "metrics": metrics, "after": after, "version": engine.version}
            finally:
                await engine.shutdown()

        return run(body())

    def test_each_rank_on_its_own_gpu(self, result, world):
        assert result["info"]["backend"] == "nccl"
        assert result["devices"] == [f"cuda:{r}" for r in range(world)]

    def test_logprobs_within_bf16_of_the_float32_oracle(self, result):
        want = result["want"]
        got = result["logprobs"].values
        atol = bf16_logprob_atol(want["scale"], LAYERS)
        assert got.dtype == torch.float32 and got.shape == want["logprobs"].shape
        assert torch.allclose(got, want["logprobs"], atol=atol, rtol=0), ((got - want["logprobs"]).abs().max(), atol)

    def test_one_step_within_bf16_of_the_float32_oracle(self, result):
        """Loss and gradient norm (both sums over all ranks' micro-batches) within bf16's error of the oracle."""
        want, m = result["want"], result["metrics"]
        rel = 2 * bf16_relative_error(LAYERS)
        assert m["loss"] == pytest.approx(want["loss"], rel=rel, abs=bf16_logprob_atol(want["scale"], LAYERS))
        assert m["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel)
        assert result["version"] == 1
        assert not torch.equal(result["after"].values, result["logprobs"].values)


@pytest.mark.gpu
class TestFSDPSpecCUDAWorld1(TrainEngineSpec):
    """The TrainEngine contract on one GPU, bf16 compute."""

    backend = "fsdp"
    options = cuda_options(1)


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
class TestFSDPSpecCUDAWorld2(TrainEngineSpec):
    """The TrainEngine contract on two GPUs (NCCL), bf16 compute."""

    backend = "fsdp"
    options = cuda_options(2)
