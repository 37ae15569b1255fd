"""``ppo``: PPO with a value head, GAE(gamma, lambda) advantages and a clipped value loss."""

from __future__ import annotations

import torch
from pydantic import Field

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms.options import VALUE_PREDS, AdvantageScope, PolicyLossOptions, RewardKLOptions
from asyncflow_plugins.algorithms.policy_loss import (
    PolicyGradientAlgorithm,
    aggregate,
    discounted_cumsum,
    scatter_kept,
    whiten,
    zero_masked,
)
from asyncflow_plugins.algorithms.reinforce import reward_kl_columns, token_rewards, unmasked_view


class PPOConfig(RewardKLOptions, PolicyLossOptions):
    """Options of ``ppo``."""

    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda: 0 = one-step TD, 1 = Monte-Carlo returns minus V.")
    whiten_advantages: bool = Field(
        True,
        description="Normalise the GAE advantages over every token of the step (returns stay unnormalised). "
        "Needs the step's rows at once (advantage_scope 'step').",
    )
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")
    value_coef: float = Field(
        0.5, ge=0, description="Weight of the value loss (0: policy only; the values then come from a frozen critic)."
    )
    value_clip: float | None = Field(
        0.2,
        gt=0,
        description="Clip the new value prediction to old value +- value_clip in the value loss (unset: no clipping).",
    )


class PPO(PolicyGradientAlgorithm):
    """Proximal Policy Optimisation with generalised advantage estimation.

    Token rewards as REINFORCE++ (R on the last token, optional KL penalty),
    ``delta_t = r_t + gamma V_{t+1} - V_t`` (V after the last token is 0),
    ``A_t = sum_l (gamma lam)^l delta_{t+l}``, returns ``A_t + V_t``. Loss:
    the shared clipped policy objective plus ``value_coef`` times
    ``1/2 max((V' - G)^2, (clip(V', V +- c) - G)^2)``, aggregated like the
    policy loss. ``V`` is the ``values`` column (pre-step estimates); ``V'``
    the ``value_preds`` column a value-head train engine adds, with grad, to
    each micro-batch. Under a ``loss_mask``, GAE runs over the unmasked tokens
    only (V and r of masked tokens are skipped, as if absent); masked tokens
    get advantage and return 0 and no value loss.
    """

    config: PPOConfig

    def __init__(self, config: PPOConfig) -> None:
        super().__init__(config)

    def _advantage_columns(self) -> list[str]:
        return [C.VALUES, *reward_kl_columns(self.config)]

    @property
    def advantage_scope(self) -> AdvantageScope:
        return "step" if self.config.whiten_advantages else "group"

    def _gae(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(advantages before whitening, returns, loss mask): over every response token, or without a
        ``loss_mask`` column; with one, packed over the unmasked tokens only and the mask to scatter them back."""
        cfg = self.config
        rewards = self.shaped_rewards(batch)  # from the whole rows (the overlong punishment counts every token)
        view, keep = unmasked_view(batch)
        offsets = view[C.RESPONSE_IDS].offsets  # type: ignore[union-attr]
        values = view[C.VALUES].values.detach().to(torch.float32)  # type: ignore[union-attr]
        token_r = token_rewards(cfg, rewards, view)
        # V_{t+1} within the row; the value after a row's last token is 0 (the episode ends)
        next_values = torch.zeros_like(values)
        next_values[:-1] = values[1:]
        ends = offsets[1:][offsets[1:] > offsets[:-1]] - 1
        next_values[ends] = 0.0
        deltas = token_r + cfg.gamma * next_values - values
        adv = discounted_cumsum(deltas, offsets, cfg.gamma * cfg.lam)
        return adv, adv + values, keep

    def _returns(self, batch: Batch) -> torch.Tensor:
        """The value targets, packed like ``response_ids`` (0 on masked tokens)."""
        _, returns, keep = self._gae(batch)
        return returns if keep is None else scatter_kept(returns, keep)

    def compute_advantages(self, batch: Batch) -> Batch:
        cfg = self.config
        offsets = batch[C.RESPONSE_IDS].offsets  # type: ignore[union-attr]
        adv, returns, keep = self._gae(batch)
        if cfg.whiten_advantages:
            adv = whiten(adv, cfg.eps)
        if keep is not None:
            adv, returns = scatter_kept(adv, keep), scatter_kept(returns, keep)
        return batch.with_columns(
            **{C.ADVANTAGES: RaggedTensor(adv, offsets), C.RETURNS: RaggedTensor(returns, offsets)}
        )

    def _extra_loss(
        self, batch: Batch, mask: torch.Tensor, ctx: LossContext
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        cfg = self.config
        if cfg.value_coef == 0:
            return None, {}
        if VALUE_PREDS not in batch:
            raise ValueError(
                f"ppo's value loss reads the value head's predictions (with grad) from a {VALUE_PREDS!r} column, "
                "which the train engine adds to each micro-batch; use a train engine with a value head "
                "(features.supports_values) or set value_coef=0 to train the policy only"
            )
        preds = batch[VALUE_PREDS].values  # type: ignore[union-attr]
        by_column = C.LOSS_MASK in batch
        if by_column:  # a masked token's value prediction leaves the graph: exactly zero gradient
            preds = torch.where(mask, preds, preds.detach())
        old = batch[C.VALUES].values.detach().to(preds.dtype)  # type: ignore[union-attr]
        # the returns survive only when the advantage and train batches are one object; else recompute (same rows)
        returns = batch[C.RETURNS].values if C.RETURNS in batch else self._returns(batch)  # type: ignore[union-attr]
        returns = returns.detach().to(preds.dtype)
        err = (preds - returns) ** 2
        clip_frac = 0.0
        if cfg.value_clip is not None:
            clipped = old + (preds - old).clamp(-cfg.value_clip, cfg.value_clip)
            err_clipped = (clipped - returns) ** 2
            with torch.no_grad():
                n = int(mask.sum())
                clip_frac = float(((err_clipped > err) & mask).sum() / n) if n else 0.0
            err = torch.maximum(err, err_clipped)
        offsets = batch[C.RESPONSE_IDS].offsets  # type: ignore[union-attr]
        if by_column:
            token_err = zero_masked(0.5 * err, mask)
            value_loss = aggregate(token_err, offsets, cfg.loss_agg, ctx, cfg.agg_norm, mask)
        else:
            value_loss = aggregate(0.5 * err * mask.to(err.dtype), offsets, cfg.loss_agg, ctx, cfg.agg_norm)
        return cfg.value_coef * value_loss, {"value_loss": float(value_loss.detach()), "value_clip_fraction": clip_frac}
