"""Helpers for tests of the ``fsdp`` engine (here and in projects that build on it).

``TINY_QWEN2`` is a randomly initialised two-layer Qwen2 small enough to train
in milliseconds on a CPU. ``GRPOWithValueLoss`` shows the optional
``value_loss`` an algorithm may define to train the engine's value head; it
lives in an importable module because algorithms are pickled to the ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms import GRPO, GRPOConfig

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


def tiny_options(**overrides: Any) -> dict[str, Any]:
    """Options of an ``fsdp`` engine on :data:`TINY_QWEN2`, one torch thread per rank, a visible learning rate."""
    return {"model": {"hf_config": dict(TINY_QWEN2)}, "lr": 1e-2, "cpu_threads_per_rank": 1, **overrides}


class GRPOWithValueLoss(GRPO):
    """GRPO plus a value regression onto the sample's reward (per token, normalised like the policy loss)."""

    def __init__(self, config: GRPOConfig | None = None, value_coef: float = 0.5) -> None:
        super().__init__(config or GRPOConfig())
        self.value_coef = value_coef

    def value_loss(self, values: RaggedTensor, batch: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        target = torch.repeat_interleave(batch[C.REWARD].to(values.values.dtype), values.lengths)
        err = (values.values - target) ** 2
        return self.value_coef * err.sum() / ctx.global_tokens, {}


class FailingAlgorithm(GRPO):
    """GRPO whose loss raises on the ranks (tests of the error path)."""

    def __init__(self) -> None:
        super().__init__(GRPOConfig())

    def loss(self, logprobs: RaggedTensor, batch: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        raise RuntimeError("deliberate failure in loss")
