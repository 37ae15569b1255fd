"""Helpers for tests of the ``megatron`` engine (here and in projects that build on it).

``TINY_QWEN2`` is a randomly initialised two-layer Qwen2 small enough to run
on a CPU in milliseconds; :func:`cpu_options` runs the engine on gloo with
megatron-core's CUDA-only calls patched in the ranks (:mod:`asyncflow_megatron.cpu`).
"""

from __future__ import annotations

from typing import Any

TINY_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 48,
    "max_position_embeddings": 128,
}


def cpu_options(**overrides: Any) -> dict[str, Any]:
    """Options of a ``megatron`` engine on :data:`TINY_QWEN2` on the CPU: one thread per rank, a visible lr."""
    return {"model": {"hf_config": dict(TINY_QWEN2)}, "device": "cpu", "use_distributed_optimizer": False,
            "start_method": "forkserver", "cpu_threads_per_rank": 1, "lr": 1e-2, **overrides}


def gpu_options(**overrides: Any) -> dict[str, Any]:
    """Options of a ``megatron`` engine on :data:`TINY_QWEN2` on CUDA (float32 so results compare exactly)."""
    return {"model": {"hf_config": dict(TINY_QWEN2)}, "device": "cuda", "params_dtype": "float32", "lr": 1e-2,
            **overrides}
