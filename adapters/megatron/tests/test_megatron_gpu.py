"""The ``megatron`` engine on CUDA: the distributed optimizer's fresh-engine load, and bf16 without Transformer Engine.

Every class here is marked ``gpu`` (skipped without CUDA; ``make test-gpu``
runs them). Written against megatron-core 0.16.1 and torch 2.13 by reading
their source, and never run on a GPU by the project yet. Device, dtype and
layer implementation are pinned in each class.

Tolerances: a fresh engine that restored everything repeats the writer's
second step; two CUDA runs of the same step can still differ by the order
of atomic additions (the embedding's backward), a few float32 roundings of
the gradient. After Adam that moves a float32 weight by far less than 2**-17
of itself (``FP32_WEIGHT_RTOL``), and a bfloat16 weight by at most one
bf16 ulp, 2**-7 of itself (a rounding that lands on the other side). A lost
optimizer state moves weights by about the learning rate (1e-2, weights are
about 2e-2): far outside both. Log-probs against the float32 Hugging Face
oracle use bf16's unit roundoff 2**-8 per rounding on a logit's path
(``asyncflow_fsdp.testing.bf16_logprob_atol``).

CI collects these through tests/adapters/test_megatron_gpu.py.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_fsdp.testing import bf16_logprob_atol
from asyncflow_megatron.testing import TINY_QWEN2, fresh_engine_round_trip, gpu_options, sample_batch
from asyncflow_plugins.hf.model import build_causal_lm

FP32_WEIGHT_RTOL = 2.0**-17
BF16_ULP = 2.0**-7
LAYERS = TINY_QWEN2["num_hidden_layers"]


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_megatron = pytest.mark.skipif(not _have_megatron(), reason="megatron-core is not installed")


def run(coro, timeout: float = 600.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def within(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> list[str]:
    """Names whose tensors differ by more than ``rtol`` of the larger magnitude, element by element."""
    bad = []
    for name, w in want.items():
        g = got[name]
        if not bool(((g - w).abs() <= rtol * torch.maximum(g.abs(), w.abs())).all()):
            bad.append(name)
    return bad


@pytest.mark.gpu
@needs_megatron
@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
class TestMegatronDistributedOptimizerResumeCUDA:
    """megatron's DistributedOptimizer (the CUDA default): save, a NEW engine loads, its next step is the writer's."""

    @pytest.fixture
    def out(self, params_dtype, tmp_path):
        options = gpu_options(params_dtype=params_dtype, use_distributed_optimizer=True, micro_batch_tokens=64,
                              export_dtype="float32")
        return run(fresh_engine_round_trip(options, tmp_path))

    def test_the_next_step_repeats(self, out, params_dtype):
        assert out["version"] == 1
        assert list(out["resumed_weights"]) == list(out["continued_weights"])
        rtol = FP32_WEIGHT_RTOL if params_dtype == "float32" else BF16_ULP
        assert within(out["resumed_weights"], out["continued_weights"], rtol) == []
        # and the steps moved the weights far more than that: the comparison can fail
        start = out["start"]
        assert not torch.allclose(out["continued"], start, atol=1e-2)


@pytest.mark.gpu
@needs_megatron
class TestMegatronBF16WithoutTransformerEngineCUDA:
    """bf16 parameters and megatron-core's own layers (``transformer_impl: local``): no TE, no Apex kernels needed.

    Rows of 32 tokens, 4 rows, 4 heads: the attention scores qualify for
    megatron's fused softmax kernel (bf16, 16 < keys <= 4096, multiples of
    4), so the engine must have switched the fusion off where the kernels do
    not import, or the first forward raises ImportError.
    """

    @pytest.fixture
    def out(self):
        if gpus() < 1:
            pytest.skip("needs a GPU")
        pm = get_plugin_manager()
        algo = pm.create("algorithm", "grpo", {})
        engine = pm.create("train_engine", "megatron", gpu_options(
            params_dtype="bfloat16", transformer_impl="local", micro_batch_tokens=4 * 32))
        batch = sample_batch(rows=4, prompt_len=12, response_len=20)

        async def body():
            await engine.setup()
            try:
                lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
                train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
                metrics = await engine.train_step(train, algo)
                return {"info": engine.info, "devices": engine.rank_devices, "logprobs": lp, "metrics": metrics}
            finally:
                await engine.shutdown()

        return {**run(body()), "batch": batch}

    def test_runs_on_the_local_layers(self, out):
        assert out["info"]["impl"] == "local" and out["info"]["backend"] == "nccl"
        assert out["devices"] == ["cuda:0"]

    def test_logprobs_within_bf16_of_the_float32_oracle(self, out):
        batch = out["batch"]
        net = build_causal_lm(ModelConfig(hf_config=dict(TINY_QWEN2)), seed=0).float()
        want, scale = [], 0.0
        with torch.no_grad():
            for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
                logits = net(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0].float()
                picked = logits[prompt.numel() - 1: prompt.numel() - 1 + response.numel()]
                scale = max(scale, float(picked.abs().max()))
                want.append(sampling_logprobs(picked, 1.0, 1.0, -1).gather(1, response.unsqueeze(1)).squeeze(1))
        want_t = torch.cat(want)
        got = out["logprobs"].values
        atol = bf16_logprob_atol(scale, LAYERS)
        assert torch.allclose(got, want_t, atol=atol, rtol=0), ((got - want_t).abs().max(), atol)

    def test_a_train_step_runs(self, out):
        m = out["metrics"]
        assert m["tokens"] == 4 * 20 and torch.isfinite(torch.tensor(m["grad_norm"])) and m["grad_norm"] > 0
