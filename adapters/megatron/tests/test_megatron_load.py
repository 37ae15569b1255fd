"""Checkpoints into a fresh ``megatron`` engine, and the CUDA settings chosen from what is installed (CPU).

* A fresh engine (new ranks, an optimizer that never stepped) loads a
  checkpoint and takes the next step exactly as the engine that wrote it:
  the Adam moments and step count come back, not only the weights. Once on
  the engine's CPU path (megatron's float32 optimizer), once with megatron's
  DistributedOptimizer on its torch-AdamW fallback, run in a spawned process
  whose parameters report a CUDA type while the optimizer is built (the one
  thing the DistributedOptimizer needs a GPU for; see
  ``asyncflow_megatron.testing.distributed_optimizer_phase``).
* ``masked_softmax_fusion`` is on only where the fused softmax kernels import;
  megatron's attention softmax then runs in bfloat16 without them.
* Checkpoints whose optimizer layout this engine cannot read are refused
  before any rank is asked.

CI runs these through tests/adapters/test_megatron_load.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
import torch

from asyncflow_core.errors import EngineError
from asyncflow_megatron.checkpoint import DISTRIBUTED_OPTIMIZER_FORMAT, load_problem, optimizer_format
from asyncflow_megatron.testing import TINY_QWEN2, cpu_options, fresh_engine_round_trip


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


HAVE_MEGATRON = _importable("megatron.core")
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install -e adapters/megatron)")

# ------------------------------------------------------------------ which checkpoints load


def test_optimizer_layouts_must_match():
    meta = {"optimizer_format": optimizer_format(True), "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    assert load_problem(meta, distributed=True, tp=1, pp=1) is None
    problem = load_problem(meta, distributed=False, tp=1, pp=1)
    assert problem and "use_distributed_optimizer: true" in problem
    local = {"optimizer_format": "local"}
    assert "use_distributed_optimizer: false" in load_problem(local, distributed=True, tp=1, pp=1)
    assert load_problem({}, distributed=False, tp=2, pp=1) is None  # older checkpoints: the plain optimizer


def test_distributed_optimizer_checkpoints_reshard_across_dp_only():
    meta = {"optimizer_format": optimizer_format(True), "tensor_parallel_size": 2, "pipeline_parallel_size": 1}
    problem = load_problem(meta, distributed=True, tp=1, pp=1)
    assert problem and DISTRIBUTED_OPTIMIZER_FORMAT in problem and "same TP and PP" in problem
    plain = {"optimizer_format": "local", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    assert load_problem(plain, distributed=False, tp=1, pp=1) is None  # megatron's plain optimizer reshards


@needs_megatron
def test_an_unreadable_checkpoint_is_refused_before_the_ranks(tmp_path):
    from asyncflow_core.plugins import get_plugin_manager

    (tmp_path / "asyncflow_megatron.json").write_text(json.dumps(
        {"format": "asyncflow-megatron/1", "version": 3, "optimizer_format": optimizer_format(True)}))
    engine = get_plugin_manager().create("train_engine", "megatron", cpu_options())
    # refused before the engine even needs ranks: the message says which option fixes it
    with pytest.raises(EngineError, match="use_distributed_optimizer: true"):
        asyncio.run(engine.load(tmp_path))


# ------------------------------------------------------------------ fused softmax


@needs_megatron
@pytest.mark.skipif(any(_importable(n) for n in ("scaled_masked_softmax_cuda",
                                                 "scaled_upper_triang_masked_softmax_cuda")),
                    reason="the fused softmax kernels are installed here")
def test_fused_softmax_is_off_without_its_kernels():
    """bf16 on CUDA without Apex's kernels: the fusion is off, and megatron's attention softmax then runs."""
    from asyncflow_megatron import hf_mapping as hm
    from asyncflow_megatron.model import fused_softmax_available, transformer_config_kwargs
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import attention_mask_func

    from asyncflow_core.config.models import ModelConfig
    from asyncflow_plugins.hf.model import hf_config

    arch = hm.architecture_from_hf(hf_config(ModelConfig(hf_config=dict(TINY_QWEN2))))
    assert not fused_softmax_available()
    kwargs = transformer_config_kwargs(arch, tp=1, pp=1, sequence_parallel=False, params_dtype=torch.bfloat16,
                                       cpu=False, recompute=False)
    assert kwargs["masked_softmax_fusion"] is False and kwargs["bf16"] is True
    assert transformer_config_kwargs(arch, tp=1, pp=1, sequence_parallel=False, params_dtype=torch.bfloat16,
                                     cpu=False, recompute=False, fused_softmax=True)["masked_softmax_fusion"] is True
    TransformerConfig(**kwargs)  # megatron's own checks accept it

    # the softmax megatron's DotProductAttention builds from that config, on scores whose shapes qualify for the
    # kernel (bf16, 16 < keys <= 4096, multiples of 4): with the fusion on it would import the missing extension
    def softmax(fusion: bool) -> FusedScaleMaskSoftmax:
        return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
                                     scaled_masked_softmax_fusion=fusion, mask_func=attention_mask_func,
                                     softmax_in_fp32=True, scale=None)

    scores = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    causal = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1)[None, None]  # the engine passes its mask
    probs = softmax(kwargs["masked_softmax_fusion"])(scores, causal)
    want = torch.softmax(scores.float().masked_fill(causal, -10000.0), dim=-1).to(torch.bfloat16)
    assert probs.dtype == torch.bfloat16 and torch.equal(probs, want)
    with pytest.raises(ImportError):
        softmax(True)(scores, causal)


# ------------------------------------------------------------------ fresh-engine round trips


@needs_megatron
def test_a_fresh_engine_resumes_the_optimizer(tmp_path):
    """Save after step 1; a new engine loads it and its step 2 equals the writer's step 2, bit for bit (CPU path)."""
    out = asyncio.run(asyncio.wait_for(fresh_engine_round_trip(cpu_options(micro_batch_tokens=64), tmp_path), 300))
    assert out["version"] == 1
    assert not torch.allclose(out["continued"], out["start"], atol=1e-2)  # the steps moved the policy
    assert torch.equal(out["resumed"], out["continued"]), (out["resumed"] - out["continued"]).abs().max()
    assert list(out["resumed_weights"]) == list(out["continued_weights"])
    assert all(torch.equal(out["resumed_weights"][n], w) for n, w in out["continued_weights"].items())


def _distributed_optimizer_available() -> bool:
    if not HAVE_MEGATRON or torch.cuda.is_available():
        return False
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE  # Apex / TE's FusedAdam cannot run on the CPU


@pytest.mark.skipif(not _distributed_optimizer_available(),
                    reason="needs megatron-core without Transformer Engine / Apex, on a machine without CUDA")
def test_distributed_optimizer_round_trip_into_a_fresh_rank(tmp_path):
    """megatron's DistributedOptimizer (torch AdamW): save, a fresh rank loads, step 2 is the same; steps are own."""
    import torch.multiprocessing as mp
    from asyncflow_megatron.testing import distributed_optimizer_phase

    for phase in ("save", "load"):
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=distributed_optimizer_phase, args=(phase, str(tmp_path)))
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0, f"{phase} phase exited with {proc.exitcode}"
    saved = torch.load(tmp_path / "save.pt", weights_only=False)
    loaded = torch.load(tmp_path / "load.pt", weights_only=False)
    assert saved["optimizer"] == loaded["optimizer"] == "DistributedOptimizer"
    # after the load every parameter has the checkpoint's step (1), each in its own tensor: torch's AdamW
    # increments a step tensor in place, so a shared one would count once per parameter
    assert [v for v, _ in loaded["steps"]] == [v for v, _ in saved["steps"]] == [1.0] * len(saved["steps"])
    assert len({ident for _, ident in loaded["steps"]}) == len(loaded["steps"])
    assert torch.equal(loaded["logprobs"], saved["logprobs"]), (loaded["logprobs"] - saved["logprobs"]).abs().max()
