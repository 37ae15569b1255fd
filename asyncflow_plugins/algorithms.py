"""Built-in algorithms: ``grpo`` (group-relative advantages, clipped policy loss)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncflow_core import columns as C
from asyncflow_core.interfaces import Algorithm, LossContext, OffPolicyCorrection
from asyncflow_core.plugins import AlgorithmBackend, hookimpl
from asyncflow_core.types import Batch, RaggedTensor


class GRPOConfig(BaseModel):
    """Options of ``grpo``."""

    model_config = ConfigDict(extra="forbid")

    group_size: int | None = Field(
        None, ge=1, description="Samples per prompt; when set, incomplete groups are an error instead of a bias."
    )
    normalize_std: bool = Field(True, description="Divide advantages by the group's reward std (off: Dr. GRPO).")
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="Ratio clip above 1 + clip_high (raise it for clip-higher).")
    correction: OffPolicyCorrection = Field(
        OffPolicyCorrection.TRUNCATED_IS,
        description="Off-policy correction: none (on-policy only), truncated_is, or decoupled (needs old_logprobs).",
    )
    is_cap: float = Field(2.0, gt=0, description="Truncation of importance weights (truncated_is, decoupled).")

    @model_validator(mode="after")
    def _clip(self) -> GRPOConfig:
        if self.clip_low >= 1:
            raise ValueError("clip_low must be < 1 so that 1 - clip_low stays positive")
        return self


class GRPO(Algorithm):
    """Group Relative Policy Optimisation.

    Advantage of sample i in group g: ``(r_i - mean_g) / (std_g + eps)``
    (std off: ``r_i - mean_g``), broadcast to every response token. Loss:
    PPO-clip on ``ratio = exp(logp - logp_old)``, summed over tokens and divided
    by the step's token count (token-level aggregation).

    ``logp_old`` and the importance weight depend on ``correction``:
    ``none``: ``logp_old`` = behavior log-probs, no weight (on-policy only);
    ``truncated_is``: ``logp_old`` = behavior log-probs detached from the sampler,
    with ``min(ratio, is_cap)`` inside the clip;
    ``decoupled``: clip against the proximal ``old_logprobs`` and weight each
    token by ``min(exp(old - behavior), is_cap)``.
    """

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config

    @property
    def required_columns(self) -> tuple[str, ...]:
        cols = [C.REWARD, C.GROUP_ID, C.BEHAVIOR_LOGPROBS]
        if self.config.correction is OffPolicyCorrection.DECOUPLED:
            cols.append(C.OLD_LOGPROBS)
        return tuple(cols)

    @property
    def correction(self) -> OffPolicyCorrection:
        return self.config.correction

    def compute_advantages(self, batch: Batch) -> Batch:
        rewards = batch[C.REWARD].to(torch.float32).reshape(-1)
        groups = batch[C.GROUP_ID].to(torch.int64).reshape(-1)
        uniq, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
        if self.config.group_size is not None and bool((counts != self.config.group_size).any()):
            bad = uniq[counts != self.config.group_size][0]
            have = counts[counts != self.config.group_size][0]
            raise ValueError(
                f"group {int(bad)} has {int(have)} samples, expected group_size={self.config.group_size}; "
                "read groups with the group-complete sampler"
            )
        k = uniq.numel()
        sums = torch.zeros(k).index_add_(0, inverse, rewards)
        means = sums / counts
        centred = rewards - means[inverse]
        adv = centred
        if self.config.normalize_std:
            # unbiased std like torch.std; a group of one has std 0
            sq = torch.zeros(k).index_add_(0, inverse, centred**2)
            std = torch.sqrt(sq / (counts - 1).clamp(min=1))
            adv = centred / (std[inverse] + self.config.eps)
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        per_token = torch.repeat_interleave(adv, resp.lengths)
        return batch.with_columns(**{C.ADVANTAGES: RaggedTensor(per_token, resp.offsets)})

    def loss(self, logprobs: RaggedTensor, batch: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        logp = logprobs.values
        adv = batch[C.ADVANTAGES].values  # type: ignore[union-attr]
        behavior = batch[C.BEHAVIOR_LOGPROBS].values.to(logp.dtype)  # type: ignore[union-attr]
        weight = torch.ones_like(logp)
        if cfg.correction is OffPolicyCorrection.DECOUPLED:
            old = batch[C.OLD_LOGPROBS].values.to(logp.dtype)  # type: ignore[union-attr]
            weight = torch.exp(old - behavior).clamp(max=cfg.is_cap).detach()
        else:
            old = behavior
        ratio = torch.exp(logp - old.detach())
        if cfg.correction is OffPolicyCorrection.TRUNCATED_IS:
            ratio = torch.minimum(ratio, torch.full_like(ratio, cfg.is_cap))
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped) * weight
        loss = per_token.sum() / ctx.global_tokens
        with torch.no_grad():
            clip_frac = ((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)).float().mean() if ratio.numel() else torch.tensor(0.0)
            metrics = {
                "clip_fraction": float(clip_frac),
                "ratio_mean": float(ratio.mean()) if ratio.numel() else 1.0,
                "mismatch_kl": float((old - logp).mean()) if logp.numel() else 0.0,
            }
        return loss, metrics


@hookimpl
def asyncflow_algorithms():
    yield AlgorithmBackend(
        name="grpo",
        factory=GRPO,
        config_model=GRPOConfig,
        description="GRPO: group-relative advantages, clipped loss, token-level aggregation, off-policy correction.",
    )
