"""Latency models of the simulated engines, calibrated by default to a 7B dense model on H100-class nodes.

Every default is an order-of-magnitude calibration from public figures, not a
measurement of one system; docs/simulation.md says where each number comes
from. All times are seconds of the loop's clock, all sizes bytes or tokens.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from pydantic import BaseModel, ConfigDict, Field

_STD_NORMAL = NormalDist()

#: bf16 parameters of a "7B" model (Qwen2.5-7B has 7.6e9), two bytes each.
DEFAULT_PARAMS = 7.6e9
DEFAULT_MODEL_BYTES = 2 * DEFAULT_PARAMS


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResponseLengths(_Model):
    """Response lengths (tokens) drawn from a lognormal, capped by each request's ``max_new_tokens``.

    A response whose uncapped draw reaches ``max_new_tokens`` ends with
    finish reason ``length``; the rest end with ``stop``. Draws are a pure
    function of a per-request uniform number, so they are reproducible.
    """

    median_tokens: float = Field(
        1500.0, gt=0, description="Median of the uncapped response length (reasoning RL on a 7B model: ~1-2k)."
    )
    sigma: float = Field(
        0.9,
        ge=0,
        description="Std of log(length); 0.9 puts p99 near 12k tokens, the long tail of reasoning rollouts.",
    )

    def quantile(self, u: float) -> float:
        """Uncapped length (continuous) at probability ``u`` in (0, 1)."""
        if self.sigma == 0:
            return self.median_tokens
        return math.exp(math.log(self.median_tokens) + self.sigma * _STD_NORMAL.inv_cdf(u))

    def cdf(self, tokens: float) -> float:
        """P(uncapped length <= ``tokens``) for the discrete length ``ceil(continuous)``."""
        if tokens <= 0:
            return 0.0
        if self.sigma == 0:
            return 1.0 if tokens >= math.ceil(self.median_tokens) else 0.0
        return _STD_NORMAL.cdf((math.log(tokens) - math.log(self.median_tokens)) / self.sigma)

    def draw(self, u: float, max_new_tokens: int, *, longer_than: int = 0) -> tuple[int, bool]:
        """``(length, capped)`` for the uniform ``u``; conditioned on being ``> longer_than``.

        A resumed partial rollout already has ``longer_than`` tokens, so its
        total length is drawn from the distribution conditioned on exceeding
        them. When the unconditioned draw already exceeds them it is kept, so
        a request resumed under its original id reproduces its original length.
        """
        u = min(max(u, 1e-12), 1 - 1e-12)
        if longer_than > 0:
            f = self.cdf(longer_than)
            if u <= f:  # map u uniformly onto (F(longer_than), 1)
                u = f + (u / f) * (1 - f) if f > 0 else u
                u = min(max(u, math.nextafter(f, 1.0)), 1 - 1e-12)
        raw = max(1, math.ceil(self.quantile(u)))
        raw = max(raw, longer_than + 1)
        if raw >= max_new_tokens:
            return max_new_tokens, True
        return raw, False

    def mean_tokens(self) -> float:
        """Mean of the uncapped lognormal."""
        return self.median_tokens * math.exp(self.sigma**2 / 2)


class RolloutLatency(_Model):
    """Cost model of one inference replica doing continuous batching (vLLM/SGLang-style).

    One decoding step of ``b`` running sequences takes
    ``step_overhead_s + (weight_read_s + per_seq_s * b) / speedup`` where
    ``speedup = devices_per_replica * tp_efficiency`` for tensor parallelism
    (1 for a single device). Admitting sequences costs a prefill of their
    prompt (plus any resumed prefix) at ``prefill_s_per_token / speedup``,
    during which the replica decodes nothing.
    """

    devices_per_replica: int = Field(1, ge=1, description="Accelerators of one replica (tensor-parallel degree).")
    step_overhead_s: float = Field(
        0.0015, ge=0, description="Per-step time TP does not shrink: scheduling, sampling, kernel launches."
    )
    weight_read_s: float = Field(
        0.0045,
        ge=0,
        description="Time to stream the bf16 weights from HBM once on one device (15.2 GB / ~3.35 TB/s).",
    )
    per_seq_s: float = Field(
        1.0e-4,
        ge=0,
        description="Marginal step time per running sequence on one device (KV reads at a few-k context + FLOPs).",
    )
    tp_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of linear speed-up tensor parallelism keeps (all-reduce per layer)."
    )
    prefill_s_per_token: float = Field(
        5.0e-5, ge=0, description="Prefill time per prompt token on one device (~20k tokens/s, compute-bound)."
    )
    kv_tokens_per_device: int = Field(
        800_000,
        ge=1,
        description="KV-cache tokens one device holds after the weights (GQA 7B: ~56 KiB/token in ~45 GB).",
    )
    max_running_seqs: int = Field(
        256, ge=1, description="Cap on sequences decoded together (vLLM's max_num_seqs default)."
    )
    sleep_s: float = Field(0.5, ge=0, description="Time of sleep(): offload weights to host, free the KV cache.")
    wake_up_s: float = Field(
        1.0, ge=0, description="Time of wake_up() after sleep(1): weights back over PCIe (~15 GB at ~25 GB/s) + KV."
    )
    wake_up_level2_s: float = Field(
        0.3, ge=0, description="Time of wake_up() after sleep(2): weights were dropped, only memory is re-allocated."
    )

    @property
    def speedup(self) -> float:
        """Effective speed-up of the replica's devices over one device."""
        if self.devices_per_replica == 1:
            return 1.0
        return self.devices_per_replica * self.tp_efficiency

    @property
    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens of the replica (prompt + response tokens of all running sequences)."""
        return self.kv_tokens_per_device * self.devices_per_replica

    def step_time(self, batch: int) -> float:
        """Seconds of one decoding step with ``batch`` running sequences."""
        return self.step_overhead_s + (self.weight_read_s + self.per_seq_s * batch) / self.speedup

    def prefill_time(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` prompt (or recomputed prefix) tokens."""
        return self.prefill_s_per_token * tokens / self.speedup

    def decode_throughput(self, batch: int) -> float:
        """Generated tokens per second of the replica at a steady running batch of ``batch``."""
        return batch / self.step_time(batch)


class TrainLatency(_Model):
    """Cost model of the trainer: 6 x params FLOPs per token at a given MFU, plus a fixed cost per step."""

    devices: int = Field(8, ge=1, description="Accelerators of the trainer group (one 8-device node).")
    params: float = Field(DEFAULT_PARAMS, gt=0, description="Trainable parameters (Qwen2.5-7B: 7.6e9).")
    peak_flops_per_device: float = Field(
        989e12, gt=0, description="Dense bf16 peak FLOP/s of one device (H100 SXM: 989e12; A100: 312e12)."
    )
    mfu: float = Field(
        0.35, gt=0, le=1, description="Model FLOPs utilisation of a train step (FSDP/Megatron 7B: ~0.3-0.45)."
    )
    step_overhead_s: float = Field(
        1.5, ge=0, description="Fixed time per optimizer step: optimizer update, gradient sync tail, host syncs."
    )
    forward_fraction: float = Field(
        1.0 / 3.0, gt=0, le=1, description="Cost of a forward-only log-prob pass relative to forward+backward."
    )
    forward_overhead_s: float = Field(
        0.2, ge=0, description="Fixed time per compute_logprobs call (batch setup, gathering results)."
    )
    checkpoint_s: float = Field(
        60.0, ge=0, description="Time of save()/load(): ~120 GB of weights + Adam state at ~2 GB/s to shared storage."
    )

    def flops_per_second(self) -> float:
        """Sustained FLOP/s of the whole trainer group."""
        return self.devices * self.peak_flops_per_device * self.mfu

    def train_time(self, tokens: int) -> float:
        """Seconds of one optimizer step over ``tokens`` (prompt + response) tokens."""
        return 6.0 * self.params * tokens / self.flops_per_second() + self.step_overhead_s

    def forward_time(self, tokens: int) -> float:
        """Seconds of a forward-only pass (old / reference log-probs) over ``tokens`` tokens."""
        return self.forward_fraction * 6.0 * self.params * tokens / self.flops_per_second() + self.forward_overhead_s


class TransferLatency(_Model):
    """Cost model of moving one weight version: ``latency_s + model_bytes / bandwidth``, per hop."""

    model_bytes: float = Field(
        DEFAULT_MODEL_BYTES, gt=0, description="Nominal bytes of one weight version (bf16 7.6B: 15.2 GB)."
    )
    send_bandwidth_bytes_per_s: float = Field(
        20e9,
        gt=0,
        description="Effective bytes/s of send(): gather shards and stage the version (NVLink/PCIe, after packing).",
    )
    receive_bandwidth_bytes_per_s: float = Field(
        20e9,
        gt=0,
        description="Effective bytes/s of one receive(): RDMA (~200-400 Gb/s NICs) or NVLink broadcast, after loading.",
    )
    latency_s: float = Field(0.1, ge=0, description="Fixed cost per send or receive: setup, barriers, metadata.")

    def send_time(self, nbytes: float | None = None) -> float:
        """Seconds to stage a version of ``nbytes`` (default: ``model_bytes``)."""
        return self.latency_s + (self.model_bytes if nbytes is None else nbytes) / self.send_bandwidth_bytes_per_s

    def receive_time(self, nbytes: float | None = None) -> float:
        """Seconds for one receiver to pull a version of ``nbytes`` (default: ``model_bytes``)."""
        return self.latency_s + (self.model_bytes if nbytes is None else nbytes) / self.receive_bandwidth_bytes_per_s


class LatencyModel(_Model):
    """Every cost model of a simulated run in one place (give the same one to all sim plugins)."""

    rollout: RolloutLatency = Field(default_factory=RolloutLatency, description="Inference replica costs.")
    lengths: ResponseLengths = Field(default_factory=ResponseLengths, description="Response length distribution.")
    train: TrainLatency = Field(default_factory=TrainLatency, description="Trainer costs.")
    transfer: TransferLatency = Field(default_factory=TransferLatency, description="Weight transfer costs.")
