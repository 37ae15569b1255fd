"""Helpers for tests of the ``fsdp`` engine (here and in projects that build on it).

``TINY_QWEN2`` is a randomly initialised two-layer Qwen2 small enough to train
in milliseconds on a CPU. :func:`local_rank` runs one rank in the test's
own process, for white-box checks of its model and optimizer. ``GRPOWithValueLoss`` shows the optional
``value_loss`` an algorithm may define to train the engine's value head; it
lives in an importable module because algorithms are pickled to the ranks.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
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
    """Options of an ``fsdp`` engine on :data:`TINY_QWEN2` on the CPU in float32, one torch thread per rank, a
    visible learning rate (pinned, so a test's figures do not depend on whether the host has a GPU)."""
    return {"model": {"hf_config": dict(TINY_QWEN2)}, "device": "cpu", "mixed_precision": "float32", "lr": 1e-2,
            "cpu_threads_per_rank": 1, **overrides}


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


def meta_init_report(rank: int, world_size: int, directory: str, model: dict[str, Any], seed: int = 0) -> None:
    """One rank of a gloo group (spawned by a test): build the sharded model as the engine does, report it.

    Writes ``rank{rank}.pt`` in ``directory``: the full (gathered) float32
    parameters, every buffer, whether all parameters were on the meta device
    before :func:`asyncflow_fsdp.init.materialize_from_rank0`, and whether
    the input and output embeddings are one parameter afterwards.
    """
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncflow_core.config.models import ModelConfig
    from asyncflow_core.launchers.rank_worker import loopback_interface
    from asyncflow_fsdp.init import materialize_from_rank0, meta_skeleton
    from asyncflow_fsdp.worker import _decoder_blocks
    from asyncflow_plugins.hf.model import build_causal_lm

    torch.set_num_threads(1)
    lo = loopback_interface()
    if lo is not None:  # gloo's sockets on loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    store = dist.FileStore(str(Path(directory) / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        cfg = ModelConfig.model_validate(model)
        source = build_causal_lm(cfg, seed=seed) if rank == 0 else None
        net = meta_skeleton(cfg)
        was_meta = all(p.is_meta for p in net.parameters())
        mesh = init_device_mesh("cpu", (world_size,))
        for block in _decoder_blocks(net):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        materialize_from_rank0(net, source, torch.device("cpu"))
        params = {name: p.full_tensor().clone() for name, p in net.named_parameters()}
        out = net.get_output_embeddings()
        report = {"params": params, "buffers": {n: b.clone() for n, b in net.named_buffers()}, "was_meta": was_meta,
                  "tied": out is not None and out.weight is net.get_input_embeddings().weight,
                  "local_numel": sum(p.to_local().numel() for p in net.parameters())}
        torch.save(report, Path(directory) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


#: unit roundoff of bfloat16 (8 significant bits): one rounding is off by at most this fraction of the value
BF16_UNIT_ROUNDOFF = 2.0**-8
#: bf16 roundings per decoder layer on a logit's path (q/k/v and output projections, attention scores and
#: weights, gate/up/down projections, the activation, two residual adds)
BF16_ROUNDINGS_PER_LAYER = 10


def bf16_relative_error(num_layers: int) -> float:
    """Worst-case relative error of a logit (and of gradients) computed in bf16 through ``num_layers`` layers.

    Each rounding on the path (per layer, plus the embedding and the head)
    adds at most one unit roundoff.
    """
    return (BF16_ROUNDINGS_PER_LAYER * num_layers + 2) * BF16_UNIT_ROUNDOFF


def bf16_logprob_atol(logits_scale: float, num_layers: int) -> float:
    """Largest log-prob error bf16 compute causes on logits of magnitude up to ``logits_scale``.

    A log-prob is a logit minus the log-sum-exp of the logits: the logits'
    absolute error, ``bf16_relative_error * logits_scale``, counts twice.
    """
    return 2 * bf16_relative_error(num_layers) * logits_scale


@contextmanager
def local_rank(options: dict[str, Any], device: str = "cpu") -> Iterator[Any]:
    """A world-1 ``fsdp`` rank (:class:`asyncflow_fsdp.worker.RankWorker`) in this process, set up on ``device``.

    For white-box tests and benchmarks that read the rank's model and
    optimizer directly (``worker.model``, ``worker.optimizer``); the process
    group (gloo on cpu, NCCL on cuda; rendezvous on 127.0.0.1) is destroyed
    on exit.
    """
    from asyncflow_fsdp.config import FSDPTrainConfig
    from asyncflow_fsdp.worker import RankWorker

    worker = RankWorker(0, 1, FSDPTrainConfig.model_validate({**options, "world_size": 1}))
    try:
        port = worker.op_bind(None)
        worker.op_setup({"port": port, "device": device})
        yield worker
    finally:
        worker.close()


def train_payload(batch: Batch, algorithm: Any, version: int = 0) -> dict[str, Any]:
    """What the driver sends a world-1 rank for one train step over ``batch`` in one micro-batch."""
    return {"batch": batch, "micro_batches": [torch.arange(batch.num_rows)], "passes": 1,
            "ctx": LossContext.of(batch, version), "algorithm": pickle.dumps(algorithm)}
