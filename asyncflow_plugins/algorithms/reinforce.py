"""``reinforce_pp``: REINFORCE++ (token-level KL penalty in the reward, returns, batch-normalised advantages)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms.options import AdvantageScope, PolicyLossOptions, RewardKLOptions
from asyncflow_plugins.algorithms.policy_loss import (
    PolicyGradientAlgorithm,
    discounted_cumsum,
    group_index,
    kept_tokens,
    kl_estimate,
    last_token_rewards,
    scatter_kept,
    whiten,
)

#: the token-aligned columns the token-level estimators read (kept to the unmasked tokens under a loss_mask)
TOKEN_COLUMNS = (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.REF_LOGPROBS, C.VALUES)


def unmasked_view(batch: Batch) -> tuple[Batch, torch.Tensor | None]:
    """``(batch, None)`` without a ``loss_mask`` column; else the token columns of its unmasked tokens and the mask.

    The token-level estimators run on the view, so masked tokens (tool or
    observation tokens) neither carry a reward nor count in the discount or
    the normalisation: the result is that of the batch without them.
    """
    keep = LossContext.token_mask(batch)
    if keep is None:
        return batch, None
    return kept_tokens(batch, keep, TOKEN_COLUMNS), keep


def token_rewards(opts: RewardKLOptions, rewards: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per-token rewards: the sequence reward on the last token, minus the KL penalty on every token.

    The penalty uses the sampling policy's log-probs (``behavior_logprobs``),
    so it is a constant of the batch, not a loss term.
    """
    offsets = batch[C.RESPONSE_IDS].offsets  # type: ignore[union-attr]
    out = last_token_rewards(rewards, offsets)
    if opts.kl_in_reward_coef > 0:
        behavior = batch[C.BEHAVIOR_LOGPROBS].values.to(torch.float32)  # type: ignore[union-attr]
        ref = batch[C.REF_LOGPROBS].values.to(torch.float32)  # type: ignore[union-attr]
        out = out - opts.kl_in_reward_coef * kl_estimate(behavior, ref, opts.kl_in_reward_estimator)
    return out


def reward_kl_columns(opts: RewardKLOptions) -> list[str]:
    """Columns the reward penalty reads."""
    return [C.REF_LOGPROBS] if opts.kl_in_reward_coef > 0 else []


class ReinforcePPConfig(RewardKLOptions, PolicyLossOptions):
    """Options of ``reinforce_pp``."""

    baseline: Literal["none", "group_mean"] = Field(
        "none",
        description="Subtract the prompt group's mean reward before computing returns ('group_mean': "
        "REINFORCE++-baseline; reads group_id) or not ('none').",
    )
    normalize_advantages: bool = Field(
        True,
        description="Normalise the returns over every token of the step: (G - mean) / (std + eps). Needs the "
        "step's rows at once (advantage_scope 'step').",
    )
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")


class ReinforcePP(PolicyGradientAlgorithm):
    """REINFORCE++.

    Token rewards ``r_t = R * [t = T-1] - beta * kl_t`` (R minus the group mean
    with ``baseline: group_mean``), returns ``G_t = sum_{s>=t} gamma^(s-t) r_s``,
    advantages ``(G - mean) / (std + eps)`` over all tokens of the batch it is
    given. The loss is the shared clipped objective. Under a ``loss_mask``
    the tokens are the unmasked ones (masked tokens get advantage 0).
    """

    config: ReinforcePPConfig

    def __init__(self, config: ReinforcePPConfig) -> None:
        super().__init__(config)

    def _advantage_columns(self) -> list[str]:
        cols = [C.GROUP_ID] if self.config.baseline == "group_mean" else []
        return cols + reward_kl_columns(self.config)

    @property
    def advantage_scope(self) -> AdvantageScope:
        return "step" if self.config.normalize_advantages else "group"

    def compute_advantages(self, batch: Batch) -> Batch:
        cfg = self.config
        rewards = self.shaped_rewards(batch)
        if cfg.baseline == "group_mean":
            uniq, inverse, counts = group_index(batch[C.GROUP_ID], None)
            means = torch.zeros(uniq.numel()).index_add_(0, inverse, rewards) / counts
            rewards = rewards - means[inverse]
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        view, keep = unmasked_view(batch)
        offsets = view[C.RESPONSE_IDS].offsets  # type: ignore[union-attr]
        returns = discounted_cumsum(token_rewards(cfg, rewards, view), offsets, cfg.gamma)
        adv = whiten(returns, cfg.eps) if cfg.normalize_advantages else returns
        if keep is not None:
            adv = scatter_kept(adv, keep)
        return batch.with_columns(**{C.ADVANTAGES: RaggedTensor(adv, resp.offsets)})
