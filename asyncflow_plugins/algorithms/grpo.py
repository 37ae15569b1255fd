"""``grpo``: group-relative advantages (with the Dr. GRPO and DAPO choices) and the shared clipped loss."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from asyncflow_core import columns as C
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms.options import FILTERED, AdvantageScope, GroupOptions, PolicyLossOptions
from asyncflow_plugins.algorithms.policy_loss import (
    PolicyGradientAlgorithm,
    equal_reward_rows,
    group_index,
    per_token,
)

RewardScale = Literal["group", "batch", "none"]


class GRPOConfig(GroupOptions, PolicyLossOptions):
    """Options of ``grpo``.

    Recipes: GRPO = the defaults with ``loss_agg: seq-mean-token-mean``;
    Dr. GRPO = ``scale_rewards: none`` + ``loss_agg: seq-mean-token-sum-norm``;
    DAPO = ``clip_high: 0.28``, ``dynamic_sampling``, ``overlong_filter`` or
    ``overlong_buffer``, token-mean aggregation (the default).
    """

    scale_rewards: RewardScale | None = Field(
        None,
        description="Divide the group-centred rewards by the reward std of the group (GRPO), of the whole batch "
        "('batch'; needs the step's rows, see advantage_scope), or not at all ('none', Dr. GRPO). "
        "Unset: 'group', or what normalize_std says.",
    )
    normalize_std: bool | None = Field(
        None, description="Older spelling of scale_rewards: true = 'group', false = 'none'. Give one of the two."
    )
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")

    @model_validator(mode="after")
    def _check_scale(self) -> GRPOConfig:
        if self.normalize_std is not None and self.scale_rewards is not None:
            implied = "group" if self.normalize_std else "none"
            if implied != self.scale_rewards:
                raise ValueError(
                    f"normalize_std={self.normalize_std} contradicts scale_rewards={self.scale_rewards!r}; "
                    "drop normalize_std (the older spelling) and keep scale_rewards"
                )
        return self

    @property
    def reward_scale(self) -> RewardScale:
        """The resolved ``scale_rewards``."""
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "none" if self.normalize_std is False else "group"


class GRPO(PolicyGradientAlgorithm):
    """Group Relative Policy Optimisation.

    Advantage of sample i in group g: ``(R_i - mean_g) / (std + eps)`` with the
    std of the group (or of the batch, or 1: ``scale_rewards``), broadcast to
    every response token; R includes the soft overlong punishment when set.
    The loss is the shared clipped objective (see
    :class:`~asyncflow_plugins.algorithms.policy_loss.PolicyGradientAlgorithm`).
    """

    config: GRPOConfig

    def __init__(self, config: GRPOConfig) -> None:
        super().__init__(config)

    def _advantage_columns(self) -> list[str]:
        return [C.GROUP_ID]

    @property
    def advantage_scope(self) -> AdvantageScope:
        return "step" if self.config.reward_scale == "batch" else "group"

    def compute_advantages(self, batch: Batch) -> Batch:
        cfg = self.config
        rewards = self.shaped_rewards(batch)
        uniq, inverse, counts = group_index(batch[C.GROUP_ID], cfg.group_size)
        k = uniq.numel()
        means = torch.zeros(k).index_add_(0, inverse, rewards) / counts
        centred = rewards - means[inverse]
        adv = centred
        scale = cfg.reward_scale
        if scale == "group":
            # unbiased std like torch.std; a group of one has std 0
            sq = torch.zeros(k).index_add_(0, inverse, centred**2)
            std = torch.sqrt(sq / (counts - 1).clamp(min=1))
            adv = centred / (std[inverse] + cfg.eps)
        elif scale == "batch":
            std = rewards.std() if rewards.numel() > 1 else torch.tensor(0.0)
            adv = centred / (std + cfg.eps)
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        out = {C.ADVANTAGES: RaggedTensor(per_token(adv, resp.offsets), resp.offsets)}
        if cfg.dynamic_sampling:
            out[FILTERED] = equal_reward_rows(rewards, inverse, k)
        return batch.with_columns(**out)
