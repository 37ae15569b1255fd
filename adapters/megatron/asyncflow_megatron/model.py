"""Building the Megatron GPTModel of one rank from an :class:`Architecture` (imports megatron-core).

Call only after ``parallel_state.initialize_model_parallel``: the model's
layers find their tensor-parallel group and pipeline stage there.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from asyncflow_megatron.hf_mapping import Architecture


def te_available() -> bool:
    """Whether Transformer Engine imports (its layer spec needs it)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure (not installed, no CUDA, ABI mismatch) means "use local"
        return False
    return True


#: the CUDA extensions megatron-core's FusedScaleMaskSoftmax imports when masked_softmax_fusion is on (built by Apex
#: or Megatron-LM's fused_kernels; the megatron-core wheel ships none of them)
FUSED_SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                            "scaled_softmax_cuda")


def fused_softmax_available() -> bool:
    """Whether the fused softmax kernels import (else megatron-core must use its torch softmax)."""
    for name in FUSED_SOFTMAX_EXTENSIONS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not built, or built for another torch/CUDA: either way unusable
            return False
    return True


def resolve_impl(requested: str, device_type: str) -> str:
    """``auto`` -> ``transformer_engine`` on CUDA when it imports, else ``local``."""
    if requested == "auto":
        return "transformer_engine" if device_type == "cuda" and te_available() else "local"
    return requested


def transformer_config_kwargs(arch: Architecture, *, tp: int, pp: int, sequence_parallel: bool,
                              params_dtype: torch.dtype, cpu: bool, recompute: bool,
                              fused_softmax: bool | None = None) -> dict[str, Any]:
    """The TransformerConfig arguments of ``arch`` (one place, so a test can read the mapping without a model).

    ``fused_softmax``: whether the fused softmax kernels can be used on CUDA; None asks
    :func:`fused_softmax_available`.
    """
    bf16 = params_dtype == torch.bfloat16
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up], silu on the gate half
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        # RL scores the sampled tokens: dropout would make log-probs of the same weights differ between passes
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        # rows of different lengths per micro-batch: pipeline stages exchange shapes before each send
        variable_seq_lengths=pp > 1,
        # megatron's config check ties variable_seq_lengths to this MoE setting even for dense models
        moe_token_dispatcher_type="alltoall",
        # the algorithm's loss is already normalised by the whole step's counts (LossContext): Megatron must add
        # micro-batch and data-parallel gradients, not average them
        calculate_per_token_loss=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        autocast_dtype=params_dtype if bf16 else None,
        use_cpu_initialization=cpu,
        # the weights are overwritten from the Hugging Face model right after, but the initialisation must run:
        # it is what marks tensor-parallel weights (`tensor_model_parallel`), and without that mark the gradient
        # norm counts only TP rank 0's slices
        perform_initialization=True,
    )
    if cpu:
        # the fused kernels are CUDA-only
        kwargs.update(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                      persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    else:
        # megatron-core's FusedScaleMaskSoftmax imports the scaled_*softmax_cuda extensions whenever the fusion is
        # on and the shapes qualify (bf16/fp16 input); without them the first forward raises ImportError, so the
        # fusion is on only where they import. Transformer Engine's attention does not use this flag.
        if fused_softmax is None:
            fused_softmax = fused_softmax_available()
        kwargs.update(bias_activation_fusion=True, masked_softmax_fusion=fused_softmax, apply_rope_fusion=False,
                      gradient_accumulation_fusion=False)
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return kwargs


def build_gpt_model(arch: Architecture, config: TransformerConfig, *, impl: str) -> GPTModel:
    """This rank's stage of the GPTModel (its layers, and the embedding / head on the first / last stage)."""
    if impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    net = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # full-vocabulary logits: top-k / top-p of the log-prob convention need every logit of a position
        parallel_output=False,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    return uniform_params_dtype(net, config.params_dtype)


def uniform_params_dtype(net: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Every floating parameter of ``net`` in ``dtype``, in place (Megatron-LM's ``Float16Module`` does the same).

    The local layer spec's norms without Apex are ``torch.nn.RMSNorm`` built
    in float32 whatever ``params_dtype`` says. megatron-core 0.16.1's
    ``DistributedOptimizer`` cannot hold a param group that mixes float32 and
    bf16 parameters: ``_build_model_and_main_param_groups`` reorders the
    group's main params as [float32..., from-bf16...] while
    ``model_param_group_index_map`` keeps the model's order, so the
    checkpoint pairs a norm's 32-element state with another parameter's
    range (``distrib_optimizer.py``, ``sharded_param_state_dp_reshardable``'s
    shape assertion; seen on the first CUDA run).
    """
    for p in net.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return net
