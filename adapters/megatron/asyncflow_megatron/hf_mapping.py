"""Hugging Face <-> megatron-core: the architecture mapping and the weight layout, both ways.

Pure torch, no megatron import, so every rule here is tested on a CPU. Three
layers of names are involved:

* **Hugging Face** names (``model.layers.3.self_attn.q_proj.weight``): what
  rollout engines load and what :meth:`TrainEngine.export_weights` yields.
* **full Megatron** names (``decoder.layers.3.self_attention.linear_qkv.weight``):
  a GPTModel state dict at TP = PP = 1, global layer numbers, unpadded vocab.
* **local Megatron** names: one rank's parameters at its TP rank and pipeline
  stage (layers numbered from 0 within the stage, vocab padded and split).

What changes shape on the way:

* ``q_proj``/``k_proj``/``v_proj`` become one ``linear_qkv`` whose rows are
  grouped per key/value head: for each of the ``G`` query groups, that group's
  ``H/G`` query heads, then its key head, then its value head (each
  ``head_dim`` rows). Tensor parallelism splits that tensor into contiguous
  slices of whole groups, so ``G`` must be a multiple of TP.
* ``gate_proj``/``up_proj`` become one ``linear_fc1`` = ``[gate; up]``; under TP
  each rank holds ``[gate slice; up slice]``, so the full tensor is *not* the
  concatenation of the rank slices (:func:`merge_tp` reorders).
* ``o_proj`` / ``down_proj`` are row-parallel (split along the input dimension);
  the embedding and output layer are vocab-parallel (split along rows, after
  padding the vocabulary to a multiple of TP with zero rows).
* Norms (and Qwen3's per-head q/k norms) are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

#: model_type values whose decoder this module maps (RMSNorm, SwiGLU, RoPE, GQA).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class UnsupportedArchitectureError(ValueError):
    """The Hugging Face config describes a model this adapter cannot express as a Megatron GPTModel."""


@dataclass(frozen=True)
class Architecture:
    """The decoder shape both sides agree on, read from a Hugging Face config."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rows in Megatron: the next multiple of ``tp`` (vocab-parallel layers split rows evenly)."""
        return -(-self.vocab_size // tp) * tp


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"expected a transformers config or a mapping, got {type(hf_config).__name__}")


def _rope_theta(d: dict[str, Any]) -> float:
    # transformers >= 5 keeps rope settings in `rope_parameters`; older releases in rope_theta + rope_scaling
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in (None, "default"):
            raise UnsupportedArchitectureError(
                f"rope_type {kind!r} (RoPE scaling) is not supported by the megatron adapter; only plain RoPE "
                "(rope_type 'default') is")
    theta = params.get("rope_theta", d.get("rope_theta"))
    return float(theta) if theta is not None else 10000.0


def architecture_from_hf(hf_config: Any) -> Architecture:
    """Read and check a Hugging Face config (object or dict); raise :class:`UnsupportedArchitectureError` saying why."""
    d = _as_dict(hf_config)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported by the megatron adapter; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (use the fsdp engine for other architectures)")
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise UnsupportedArchitectureError(f"the {model_type} config lacks {', '.join(missing)}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported; the mapping is for SwiGLU (silu)")
    heads = int(d["num_attention_heads"])
    groups = int(d.get("num_key_value_heads") or heads)
    if heads % groups:
        raise UnsupportedArchitectureError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                           f"{groups}")
    if d.get("use_sliding_window") or (model_type == "mistral" and d.get("sliding_window") is not None):
        raise UnsupportedArchitectureError("sliding-window attention is not supported by the megatron adapter; set "
                                           "use_sliding_window: false (or sliding_window: null for mistral)")
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedArchitectureError(f"layer_types {sorted(set(layer_types))} are not supported; every layer "
                                           "must be full_attention")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no other linear bias
    else:
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise UnsupportedArchitectureError(f"{model_type} with attention_bias or mlp_bias is not supported (the "
                                               "mapping covers bias-free projections)")
        qkv_bias = False
    hidden = int(d["hidden_size"])
    head_dim = d.get("head_dim") or hidden // heads
    return Architecture(
        model_type=model_type,
        num_layers=int(d["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(d["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(head_dim),
        vocab_size=int(d["vocab_size"]),
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        rope_theta=_rope_theta(d),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        qk_layernorm=model_type == "qwen3",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def check_parallelism(arch: Architecture, tp: int, pp: int) -> None:
    """Raise ``ValueError`` (one line per problem) when the model cannot be split ``tp`` x ``pp`` ways."""
    problems = []
    if arch.num_attention_heads % tp:
        problems.append(f"num_attention_heads {arch.num_attention_heads} is not a multiple of "
                        f"tensor_parallel_size {tp}")
    if arch.num_query_groups % tp:
        problems.append(f"num_key_value_heads {arch.num_query_groups} is not a multiple of tensor_parallel_size {tp}")
    if arch.ffn_hidden_size % tp:
        problems.append(f"intermediate_size {arch.ffn_hidden_size} is not a multiple of tensor_parallel_size {tp}")
    if arch.num_layers % pp:
        problems.append(f"num_hidden_layers {arch.num_layers} is not a multiple of pipeline_parallel_size {pp}")
    if problems:
        raise ValueError("; ".join(problems) + "; choose sizes that divide the model")


# -- per-tensor rules -----------------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """``q_proj``/``k_proj``/``v_proj`` (weights or biases) -> Megatron's grouped ``linear_qkv``."""
    g, d = arch.num_query_groups, arch.kv_channels
    tail = q.shape[1:]
    parts = (q.reshape(g, arch.heads_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(g * (arch.heads_per_group + 2) * d, *tail)


def split_qkv(qkv: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's grouped ``linear_qkv`` -> ``(q_proj, k_proj, v_proj)`` (weights or biases)."""
    g, d, hpg = arch.num_query_groups, arch.kv_channels, arch.heads_per_group
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(g * hpg * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate_proj``/``up_proj`` -> ``linear_fc1`` = ``[gate; up]`` (Megatron's GLU applies silu to the first half)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_fc1`` -> ``(gate_proj, up_proj)``."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


# -- whole state dicts ----------------------------------------------------------------------------------------------

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MC_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _norm_names(te_names: bool) -> tuple[str, str]:
    """Megatron names of the two per-layer norms: fused into the next linear with Transformer Engine specs."""
    if te_names:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def hf_layer_names(arch: Architecture) -> list[str]:
    """Per-layer Hugging Face parameter suffixes, in the order :func:`megatron_to_hf` yields them."""
    names = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.v_proj.weight"]
    if arch.qkv_bias:
        names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if arch.qk_layernorm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += ["self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight"]
    return names


def hf_names(arch: Architecture) -> list[str]:
    """Every Hugging Face parameter the export yields, in export order (embedding, layers, final norm, head)."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        names += [f"model.layers.{i}.{s}" for s in hf_layer_names(arch)]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def hf_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor :func:`hf_names` lists."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    per_layer = {
        "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    out: dict[str, tuple[int, ...]] = {}
    for name in hf_names(arch):
        m = _HF_LAYER.match(name)
        out[name] = per_layer[m.group(2)] if m else ((h,) if name == "model.norm.weight" else (arch.vocab_size, h))
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: Architecture, *, te_names: bool = False
                   ) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> the full Megatron GPTModel state dict (TP = PP = 1, unpadded vocab).

    Raises ``ValueError`` naming missing or unexpected tensors. Tensors are
    views or new tensors; ``hf`` is not modified.
    """
    want = set(hf_names(arch))
    have = set(hf)
    if arch.tie_word_embeddings:
        have.discard("lm_head.weight")  # transformers lists the tied head under its own name too
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        raise ValueError(f"the Hugging Face state dict does not match the {arch.model_type} architecture: "
                         f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
    in_norm, mlp_norm = _norm_names(te_names)
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = p + "self_attn."
        out[m + in_norm] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], arch)
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], arch)
        if arch.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[m + mlp_norm] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = fuse_gate_up(hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"])
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_layer_to_hf(suffix: str, tensor: torch.Tensor, arch: Architecture, *, te_names: bool = False
                         ) -> list[tuple[str, torch.Tensor]]:
    """One full (TP-merged) Megatron layer parameter -> its Hugging Face suffix(es), e.g. qkv -> q, k, v."""
    in_norm, mlp_norm = _norm_names(te_names)
    if suffix == in_norm:
        return [("input_layernorm.weight", tensor)]
    if suffix == mlp_norm:
        return [("post_attention_layernorm.weight", tensor)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, arch)
        return [(f"self_attn.q_proj.{kind}", q), (f"self_attn.k_proj.{kind}", k), (f"self_attn.v_proj.{kind}", v)]
    if suffix == "self_attention.q_layernorm.weight":
        return [("self_attn.q_norm.weight", tensor)]
    if suffix == "self_attention.k_layernorm.weight":
        return [("self_attn.k_norm.weight", tensor)]
    if suffix == "self_attention.linear_proj.weight":
        return [("self_attn.o_proj.weight", tensor)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = split_gate_up(tensor)
        return [("mlp.gate_proj.weight", gate), ("mlp.up_proj.weight", up)]
    if suffix == "mlp.linear_fc2.weight":
        return [("mlp.down_proj.weight", tensor)]
    raise ValueError(f"no Hugging Face name for Megatron layer parameter {suffix!r}")


def megatron_to_hf(mc: Mapping[str, torch.Tensor], arch: Architecture, *, te_names: bool = False
                   ) -> dict[str, torch.Tensor]:
    """The full Megatron state dict -> Hugging Face names (inverse of :func:`hf_to_megatron`; tied head omitted)."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in mc.items():
        if name.endswith("_extra_state"):
            continue
        m = _MC_LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
        elif name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor[: arch.vocab_size]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = tensor
        elif name == "output_layer.weight":
            if not arch.tie_word_embeddings:
                out["lm_head.weight"] = tensor[: arch.vocab_size]
        else:
            raise ValueError(f"no Hugging Face name for Megatron parameter {name!r}")
    for i in sorted(layers):
        for suffix, tensor in layers[i].items():
            for hf_suffix, t in megatron_layer_to_hf(suffix, tensor, arch, te_names=te_names):
                out[f"model.layers.{i}.{hf_suffix}"] = t
    return {name: out[name] for name in hf_names(arch) if name in out}


# -- tensor and pipeline parallel layout ----------------------------------------------------------------------------

Partition = Literal["vocab", "column", "row", "fc1", "replicated"]


def tp_partition(name: str) -> Partition:
    """How tensor parallelism splits the Megatron parameter ``name`` (full or local name)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def split_tp(name: str, tensor: torch.Tensor, arch: Architecture, tp: int) -> list[torch.Tensor]:
    """A full Megatron tensor -> the ``tp`` slices the tensor-parallel ranks hold (vocab padded with zero rows)."""
    kind = tp_partition(name)
    if kind == "replicated" or (tp == 1 and kind != "vocab"):
        return [tensor] * tp
    if kind == "vocab":
        pad = arch.padded_vocab_size(tp) - tensor.shape[0]
        if pad:
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        return list(torch.chunk(tensor, tp, dim=0))
    if kind == "column":
        return list(torch.chunk(tensor, tp, dim=0))
    if kind == "row":
        return list(torch.chunk(tensor, tp, dim=1))
    gate, up = split_gate_up(tensor)
    return [torch.cat([g, u]) for g, u in zip(torch.chunk(gate, tp), torch.chunk(up, tp), strict=True)]


def merge_tp(name: str, shards: list[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """The tensor-parallel slices of ``name`` -> the full Megatron tensor (inverse of :func:`split_tp`)."""
    kind = tp_partition(name)
    if kind == "replicated":
        return shards[0]
    if kind == "vocab":
        return torch.cat(shards, dim=0)[: arch.vocab_size]
    if kind == "column":
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    halves = [split_gate_up(s) for s in shards]
    return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])


def stage_layers(arch: Architecture, pp: int, stage: int) -> range:
    """Global layer numbers held by pipeline ``stage`` (layers are split evenly)."""
    per = arch.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_of(name: str, arch: Architecture, pp: int) -> int:
    """The pipeline stage that holds the full Megatron parameter ``name`` (the tied output layer: the first)."""
    m = _MC_LAYER.match(name)
    if m:
        return int(m.group(1)) // (arch.num_layers // pp)
    if name.startswith("embedding."):
        return 0
    return pp - 1


def to_local_name(name: str, arch: Architecture, pp: int) -> str:
    """Full (global layer) Megatron name -> the name inside its stage's GPTModel."""
    m = _MC_LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) % (arch.num_layers // pp)}.{m.group(2)}"


def to_global_name(name: str, arch: Architecture, pp: int, stage: int) -> str:
    """Name inside stage ``stage``'s GPTModel -> the full (global layer) Megatron name."""
    m = _MC_LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) + stage * (arch.num_layers // pp)}.{m.group(2)}"


def shard_for_rank(full: Mapping[str, torch.Tensor], arch: Architecture, *, tp: int, pp: int, tp_rank: int,
                   stage: int) -> dict[str, torch.Tensor]:
    """The local state dict of the rank at (``tp_rank``, ``stage``): its stage's tensors, its TP slices."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if stage_of(name, arch, pp) != stage:
            continue
        out[to_local_name(name, arch, pp)] = split_tp(name, tensor, arch, tp)[tp_rank]
    if arch.tie_word_embeddings and pp > 1 and stage == pp - 1:
        # the last stage keeps its own copy of the tied embedding as the output layer (kept equal by Megatron's
        # embedding-group all-reduce of their gradients)
        out["output_layer.weight"] = split_tp("output_layer.weight", full["embedding.word_embeddings.weight"],
                                              arch, tp)[tp_rank]
    return out
