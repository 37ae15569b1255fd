"""A tiny random Qwen2 that vLLM's CPU backend runs (attention head dimension 64), for tests and benchmarks."""

from __future__ import annotations

from typing import Any

#: vLLM's CPU attention needs a supported head dimension: 64 works, 16 does not.
TINY_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "initializer_range": 0.2,
    "eos_token_id": 31,
}


def tiny_options(**overrides: Any) -> dict[str, Any]:
    """Options of the ``vllm`` engine for :data:`TINY_QWEN2` on CPU (small KV cache, few sequences)."""
    options: dict[str, Any] = {
        "model": {"hf_config": dict(TINY_QWEN2)},
        "device": "cpu",
        "cpu_kv_cache_gb": 1,
        "max_num_seqs": 32,
        "max_model_len": 512,
        "seed": 0,
    }
    options.update(overrides)
    return options
