"""``rloo``: REINFORCE with a leave-one-out baseline (each sample's baseline is its group's other samples)."""

from __future__ import annotations

import torch
from pydantic import model_validator

from asyncflow_core import columns as C
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms.options import FILTERED, GroupOptions, PolicyLossOptions
from asyncflow_plugins.algorithms.policy_loss import (
    PolicyGradientAlgorithm,
    equal_reward_rows,
    group_index,
    per_token,
)


class RLOOConfig(GroupOptions, PolicyLossOptions):
    """Options of ``rloo`` (groups need at least two samples: rollout.n >= 2)."""

    @model_validator(mode="after")
    def _check_rloo(self) -> RLOOConfig:
        if self.group_size == 1:
            raise ValueError("rloo needs group_size >= 2: the leave-one-out baseline of a lone sample is undefined")
        return self


class RLOO(PolicyGradientAlgorithm):
    """REINFORCE Leave-One-Out.

    Advantage of sample i in a group of n: ``R_i - (sum_g - R_i) / (n - 1)``
    (equivalently ``n / (n - 1) * (R_i - mean_g)``), broadcast to every
    response token. No std scaling. A group of one has no baseline: error.
    """

    config: RLOOConfig

    def __init__(self, config: RLOOConfig) -> None:
        super().__init__(config)

    def _advantage_columns(self) -> list[str]:
        return [C.GROUP_ID]

    def compute_advantages(self, batch: Batch) -> Batch:
        cfg = self.config
        rewards = self.shaped_rewards(batch)
        uniq, inverse, counts = group_index(batch[C.GROUP_ID], cfg.group_size)
        if bool((counts < 2).any()):
            bad = int(uniq[counts < 2][0])
            raise ValueError(
                f"group {bad} has 1 sample: the leave-one-out baseline needs at least 2 per prompt; "
                "set rollout.n >= 2 and read whole groups (the group-complete sampler)"
            )
        sums = torch.zeros(uniq.numel()).index_add_(0, inverse, rewards)
        others = (sums[inverse] - rewards) / (counts[inverse] - 1)
        adv = rewards - others
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        out = {C.ADVANTAGES: RaggedTensor(per_token(adv, resp.offsets), resp.offsets)}
        if cfg.dynamic_sampling:
            out[FILTERED] = equal_reward_rows(rewards, inverse, uniq.numel())
        return batch.with_columns(**out)
