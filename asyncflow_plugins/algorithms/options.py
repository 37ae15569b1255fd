"""Option models the built-in algorithms share, and the columns they add to the standard set.

Each algorithm's config model is built from these pieces (pydantic
inheritance), so one option means the same thing in every algorithm and is
documented once. Every model forbids unknown keys; combinations that cannot
work are refused with a message saying what to change.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncflow_core.interfaces import OffPolicyCorrection

#: ``filtered`` (written by ``compute_advantages`` under dynamic sampling: the runtime drops those groups as
#: ``filtered``), ``truncated`` (the rollout stage writes it from finish reason ``length``) and ``value_preds``
#: (a value-head train engine's predictions with grad) are standard columns.
from asyncflow_core.columns import FILTERED, TRUNCATED, VALUE_PREDS  # noqa: E402,F401

KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AdvantageScope = Literal["group", "step"]


class PolicyLossOptions(BaseModel):
    """The clipped policy loss, its aggregation, the KL-to-reference term, off-policy correction, overlong handling."""

    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 - clip_low (PPO's epsilon; DAPO's eps_low).")
    clip_high: float = Field(
        0.2, ge=0, description="Ratio clip above 1 + clip_high (DAPO clip-higher: raise it, e.g. 0.28)."
    )
    correction: OffPolicyCorrection = Field(
        OffPolicyCorrection.TRUNCATED_IS,
        description="Off-policy correction: none (on-policy only, k=0), truncated_is (ratio against the behavior "
        "log-probs, truncated at is_cap), or decoupled (clip against old_logprobs, IS weight behavior->old "
        "truncated at is_cap; runs an extra log-prob pass).",
    )
    is_cap: float = Field(2.0, gt=0, description="Truncation of importance weights (truncated_is, decoupled).")
    loss_agg: LossAggregation = Field(
        "token-mean",
        description="How token losses become the step loss: token-mean (every token of the step weighs the same; "
        "DAPO, the default), seq-mean-token-mean (mean per sequence, then mean over sequences; original GRPO), "
        "seq-mean-token-sum-norm (token sums over sequences x a constant; Dr. GRPO).",
    )
    loss_agg_norm: int | None = Field(
        None,
        ge=1,
        description="The constant token count of seq-mean-token-sum-norm (Dr. GRPO: the generation budget); "
        "defaults to max_response_length.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the per-token KL to the reference policy in the loss (0: off; reads ref_logprobs).",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of an entropy bonus (0: off), estimated from the sampled tokens: the surrogate "
        "logp.detach() * logp has the gradient of -entropy in expectation; keeps small policies exploring.",
    )
    kl_estimator: KLEstimator = Field(
        "k3",
        description="Per-token KL estimator of the loss term: k1 = logp - ref, k2 = (logp - ref)^2 / 2, "
        "k3 = exp(ref - logp) - (ref - logp) - 1 (non-negative, unbiased).",
    )
    max_response_length: int | None = Field(
        None,
        ge=1,
        description="The rollout's max_new_tokens: a response this long hit the budget (overlong filter and "
        "punishment; default of loss_agg_norm).",
    )
    overlong_filter: bool = Field(
        False, description="DAPO overlong filtering: truncated samples get no loss (their tokens are masked)."
    )
    truncation_signal: Literal["length", "column"] = Field(
        "length",
        description="How a truncated sample is recognised: length (response length >= max_response_length) or "
        "column (a dense bool 'truncated' column, which the rollout stage must then produce).",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO soft overlong punishment: responses longer than max_response_length - overlong_buffer "
        "lose up to overlong_penalty reward, linearly in the excess length (unset: off).",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="Reward lost by a response at max_response_length (soft punishment)."
    )

    @model_validator(mode="after")
    def _check_policy_loss(self) -> PolicyLossOptions:
        if self.clip_low >= 1:
            raise ValueError("clip_low must be < 1 so that 1 - clip_low stays positive")
        no_norm = self.loss_agg_norm is None and self.max_response_length is None
        if self.loss_agg == "seq-mean-token-sum-norm" and no_norm:
            raise ValueError(
                "loss_agg='seq-mean-token-sum-norm' divides by a constant token count: set loss_agg_norm "
                "(or max_response_length) to the generation budget, e.g. the rollout's max_new_tokens"
            )
        if self.overlong_filter and self.truncation_signal == "length" and self.max_response_length is None:
            raise ValueError(
                "overlong_filter with truncation_signal='length' needs max_response_length (the rollout's "
                "max_new_tokens); or set truncation_signal='column' if the rollout writes a 'truncated' column"
            )
        if self.overlong_buffer is not None:
            if self.max_response_length is None:
                raise ValueError("overlong_buffer needs max_response_length (the rollout's max_new_tokens)")
            if self.overlong_buffer >= self.max_response_length:
                raise ValueError(
                    f"overlong_buffer={self.overlong_buffer} must be smaller than "
                    f"max_response_length={self.max_response_length} (DAPO uses about a fifth of it)"
                )
        return self

    @property
    def agg_norm(self) -> int | None:
        """The constant of seq-mean-token-sum-norm (``loss_agg_norm``, else ``max_response_length``)."""
        return self.loss_agg_norm if self.loss_agg_norm is not None else self.max_response_length


class GroupOptions(BaseModel):
    """Options of group-baseline estimators (GRPO, RLOO): group completeness and dynamic sampling."""

    model_config = ConfigDict(extra="forbid")

    group_size: int | None = Field(
        None, ge=1, description="Samples per prompt; when set, incomplete groups are an error instead of a bias."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: groups whose rewards are all equal (no signal) are marked 'filtered' "
        "so the runtime drops them and trains on groups that carry a gradient.",
    )

    @model_validator(mode="after")
    def _check_group(self) -> GroupOptions:
        if self.dynamic_sampling and self.group_size == 1:
            raise ValueError(
                "dynamic_sampling with group_size=1 would filter every group (a group of one has equal rewards); "
                "sample several responses per prompt (rollout.n > 1) or turn dynamic_sampling off"
            )
        return self


class RewardKLOptions(BaseModel):
    """A token-level KL penalty folded into the rewards before returns are computed (REINFORCE++, PPO)."""

    model_config = ConfigDict(extra="forbid")

    kl_in_reward_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the per-token KL penalty subtracted from each token's reward (0: off; reads "
        "ref_logprobs). Uses the sampling policy's log-probs, so it carries no gradient.",
    )
    kl_in_reward_estimator: KLEstimator = Field("k1", description="KL estimator of the reward penalty (k1, k2 or k3).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of future token rewards.")
