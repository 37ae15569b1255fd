"""The policy loss every built-in algorithm shares, and the per-token arithmetic it is made of.

An algorithm subclasses :class:`PolicyGradientAlgorithm` and supplies the
advantage estimator; the loss (clipped ratio, off-policy correction, KL to the
reference, masks, aggregation) is written once, here. The formulas are in
docs/algorithms.md.

With a ``loss_mask`` column, a masked token contributes nothing: its log-prob
(and value prediction) is cut from the graph, so its gradient is exactly
zero; its per-token terms are replaced by zero (not multiplied by it, so a NaN
in a masked token's inputs stays out); ``seq-mean-token-mean`` divides by the
unmasked tokens of each row; and the token-level estimators (REINFORCE++,
PPO) run on the unmasked tokens only, as if the masked ones were not there.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import Algorithm, LossContext, OffPolicyCorrection
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms.options import TRUNCATED, AdvantageScope, KLEstimator, PolicyLossOptions

#: bound on log(pi_ref / pi) inside k3, so one token with a vanishing probability cannot make the loss inf
_K3_LOG_RATIO_BOUND = 20.0


# ------------------------------------------------------------------------------------- per-token arithmetic


def token_rows(offsets: torch.Tensor) -> torch.Tensor:
    """Row index of every packed token (int64, one per token)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


def kept_offsets(offsets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Offsets of the ragged tensor left when only the tokens where ``keep`` is true remain (rows may empty)."""
    counts = torch.zeros(offsets.numel() - 1, dtype=torch.int64, device=offsets.device)
    counts.index_add_(0, token_rows(offsets), keep.to(torch.int64))
    return torch.cat([offsets.new_zeros(1), counts.cumsum(0).to(offsets.dtype)])


def kept_tokens(batch: Batch, keep: torch.Tensor, names: tuple[str, ...]) -> Batch:
    """The token-aligned ragged columns ``names`` (those present) with only the tokens where ``keep`` is true."""
    offsets = kept_offsets(batch[C.RESPONSE_IDS].offsets, keep)  # type: ignore[union-attr]
    cols = {n: RaggedTensor(batch[n].values[keep], offsets) for n in names if n in batch}  # type: ignore[union-attr]
    return Batch(cols, num_rows=batch.num_rows)


def scatter_kept(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Back to every token: ``values`` (one per kept token) where ``keep`` is true, zero elsewhere."""
    out = values.new_zeros(keep.numel())
    out[keep] = values
    return out


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is true, exactly zero elsewhere (even where ``values`` is inf or NaN)."""
    return torch.where(mask, values, values.new_zeros(()))


def per_token(row_values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per row to every token of that row.

    A 1-D CPU tensor outside autograd (advantages, masks) goes through ``numpy.repeat``: 5 µs against 45 µs
    for ``torch.repeat_interleave`` here, and no release of the GIL, which the driver's advantage stage would
    otherwise hand to the rollout engine's thread and wait to get back.
    """
    if (row_values.device.type == "cpu" and offsets.device.type == "cpu" and row_values.dim() == 1
            and not row_values.requires_grad and row_values.dtype in _NUMPY_REPEAT):
        return torch.from_numpy(np.repeat(row_values.numpy(), np.diff(offsets.numpy())))
    return torch.repeat_interleave(row_values, offsets[1:] - offsets[:-1])


#: dtypes :func:`per_token` repeats in numpy (the same dtype comes back)
_NUMPY_REPEAT = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool)


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    With ``d = ref - logp`` (log of pi_ref / pi): k1 = -d, k2 = d^2 / 2,
    k3 = exp(d) - d - 1 (d bounded to +-20 so the exponential stays finite).
    """
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    d = d.clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return torch.exp(d) - d - 1


def aggregate(
    losses: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    ctx: LossContext,
    norm: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The micro-batch's share of the step loss from per-token losses (masked tokens already zero).

    Every mode divides by whole-step counts from ``ctx``, so micro-batch
    results add up to the loss of the whole step. With ``mask`` (the
    ``loss_mask`` column), a sequence's length in ``seq-mean-token-mean`` is
    its count of unmasked tokens.
    """
    if mode == "token-mean":
        return losses.sum() / max(ctx.global_tokens, 1)
    if mode == "seq-mean-token-mean":
        lengths = offsets[1:] - offsets[:-1] if mask is None else kept_offsets(offsets, mask).diff()
        lengths = lengths.clamp(min=1).to(losses.dtype)
        per_seq = torch.zeros(lengths.numel(), dtype=losses.dtype, device=losses.device)
        per_seq = per_seq.index_add(0, token_rows(offsets), losses)
        return (per_seq / lengths).sum() / max(ctx.global_sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        if norm is None:
            raise ValueError("seq-mean-token-sum-norm needs a constant token count (loss_agg_norm)")
        return losses.sum() / (max(ctx.global_sequences, 1) * norm)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def discounted_cumsum(values: torch.Tensor, offsets: torch.Tensor, discount: float) -> torch.Tensor:
    """``out_t = sum_{s >= t} discount^(s - t) * values_s`` within each row (packed in, packed out).

    Computed in float64 on a padded rectangle; padding sits after each row's
    end and is zero, so it adds nothing.
    """
    padded, mask = RaggedTensor(values.to(torch.float64), offsets).to_padded(0.0)
    if discount == 1.0:
        out = padded.flip(1).cumsum(1).flip(1)
    else:
        out = torch.empty_like(padded)
        acc = torch.zeros(padded.shape[0], dtype=torch.float64)
        for t in range(padded.shape[1] - 1, -1, -1):
            acc = padded[:, t] + discount * acc
            out[:, t] = acc
    return out[mask].to(values.dtype)


def last_token_rewards(rewards: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-token rewards that are zero except the sequence reward on each row's last token."""
    out = torch.zeros(int(offsets[-1]), dtype=torch.float32)
    lengths = offsets[1:] - offsets[:-1]
    nonempty = lengths > 0
    out[offsets[1:][nonempty] - 1] = rewards.to(torch.float32)[nonempty]
    return out


def whiten(values: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over all elements (unbiased std; fewer than two elements: centred only)."""
    if values.numel() == 0:
        return values
    centred = values - values.mean()
    if values.numel() < 2:
        return centred
    return centred / (values.std() + eps)


# ----------------------------------------------------------------------------------------- the base class


class PolicyGradientAlgorithm(Algorithm):
    """Shared loss of the built-ins: a clipped ratio objective with a declared off-policy correction.

    Subclasses implement :meth:`compute_advantages` and may add columns
    (:meth:`_extra_columns`) and per-token loss terms (:meth:`_extra_loss`).
    """

    config: PolicyLossOptions
    #: masked tokens contribute nothing (checked by AlgorithmSpec; read through ``algorithm_features``)
    honours_loss_mask = True

    def __init__(self, config: PolicyLossOptions) -> None:
        self.config = config

    # -- declarations ----------------------------------------------------------------------

    @property
    def correction(self) -> OffPolicyCorrection:
        return self.config.correction

    @property
    def required_columns(self) -> tuple[str, ...]:
        cfg = self.config
        cols = [C.REWARD, *self._advantage_columns(), C.BEHAVIOR_LOGPROBS]
        if cfg.correction is OffPolicyCorrection.DECOUPLED:
            cols.append(C.OLD_LOGPROBS)
        if cfg.kl_coef > 0:
            cols.append(C.REF_LOGPROBS)
        if cfg.overlong_filter and cfg.truncation_signal == "column":
            cols.append(TRUNCATED)
        return tuple(dict.fromkeys(cols))

    @property
    def advantage_scope(self) -> AdvantageScope:
        """Which rows ``compute_advantages`` must see at once.

        ``group``: one prompt group is enough (the advantage stage's lease).
        ``step``: the estimator normalises over the whole optimizer step, so
        it must be called on the train batch; per group it would normalise
        within the group instead.
        """
        return "group"

    def _advantage_columns(self) -> list[str]:
        """Columns the estimator reads besides ``reward`` (e.g. ``group_id``, ``values``)."""
        return []

    # -- shared pieces of the estimators ---------------------------------------------------------

    def truncated(self, batch: Batch) -> torch.Tensor:
        """Bool per row: the response stopped at the generation budget."""
        cfg = self.config
        if cfg.truncation_signal == "column":
            return batch[TRUNCATED].to(torch.bool).reshape(-1)
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        if cfg.max_response_length is None:
            return torch.zeros(batch.num_rows, dtype=torch.bool)
        return resp.lengths >= cfg.max_response_length

    def shaped_rewards(self, batch: Batch) -> torch.Tensor:
        """The scalar rewards plus DAPO's soft overlong punishment when ``overlong_buffer`` is set.

        With L = max_response_length and b = overlong_buffer, a response of
        length l loses ``overlong_penalty * (l - (L - b)) / b`` when
        ``l > L - b`` (at most ``overlong_penalty``, at l = L).
        """
        rewards = batch[C.REWARD].to(torch.float32).reshape(-1)
        cfg = self.config
        if cfg.overlong_buffer is None:
            return rewards
        assert cfg.max_response_length is not None  # checked by the config model
        lengths = batch[C.RESPONSE_IDS].lengths.to(torch.float32)  # type: ignore[union-attr]
        excess = (lengths - (cfg.max_response_length - cfg.overlong_buffer)).clamp(min=0, max=cfg.overlong_buffer)
        return rewards - cfg.overlong_penalty * excess / cfg.overlong_buffer

    def loss_mask(self, batch: Batch) -> torch.Tensor:
        """Bool per token: the token contributes to the loss.

        Overlong filtering masks truncated samples; a ``loss_mask`` column
        masks its zero tokens.
        """
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        keep = torch.ones(batch.num_rows, dtype=torch.bool, device=resp.offsets.device)
        if self.config.overlong_filter:
            keep = ~self.truncated(batch).to(resp.offsets.device)
        mask = per_token(keep, resp.offsets)
        column = LossContext.token_mask(batch)
        return mask if column is None else mask & column.to(mask.device)

    # -- the loss ----------------------------------------------------------------------------------

    def loss(self, logprobs: RaggedTensor, batch: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        logp = logprobs.values
        offsets = batch[C.RESPONSE_IDS].offsets  # type: ignore[union-attr]
        adv = batch[C.ADVANTAGES].values.detach().to(logp.dtype)  # type: ignore[union-attr]
        behavior = batch[C.BEHAVIOR_LOGPROBS].values.to(logp.dtype)  # type: ignore[union-attr]
        mask = self.loss_mask(batch)
        maskf = mask.to(logp.dtype)
        by_column = C.LOSS_MASK in batch
        if by_column:
            # a masked token's log-prob leaves the graph: its gradient is exactly zero whatever its inputs hold
            logp = torch.where(mask, logp, logp.detach())

        def masked(values: torch.Tensor) -> torch.Tensor:
            # without the column, the arithmetic of the overlong filter as before (bit for bit)
            return zero_masked(values, mask) if by_column else values * maskf

        col_mask = mask if by_column else None

        # the anchor of the ratio and the importance weight, per the declared correction
        weight = torch.ones_like(logp)
        if cfg.correction is OffPolicyCorrection.DECOUPLED:
            old = batch[C.OLD_LOGPROBS].values.to(logp.dtype)  # type: ignore[union-attr]
            weight = torch.exp(old - behavior).clamp(max=cfg.is_cap).detach()
        else:
            old = behavior
        ratio = torch.exp(logp - old.detach())
        if cfg.correction is OffPolicyCorrection.TRUNCATED_IS:
            # the anchor is the sampler itself: the ratio is the IS weight, truncated
            ratio = torch.minimum(ratio, torch.full_like(ratio, cfg.is_cap))
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        pg = -torch.minimum(ratio * adv, clipped * adv) * weight
        token_loss = masked(pg)
        pg_loss = aggregate(token_loss, offsets, cfg.loss_agg, ctx, cfg.agg_norm, col_mask)
        total = pg_loss

        metrics: dict[str, float] = {}
        if cfg.kl_coef > 0:
            ref = batch[C.REF_LOGPROBS].values.to(logp.dtype)  # type: ignore[union-attr]
            kl = masked(kl_estimate(logp, ref.detach(), cfg.kl_estimator))
            total = total + cfg.kl_coef * aggregate(kl, offsets, cfg.loss_agg, ctx, cfg.agg_norm, col_mask)
            metrics["kl"] = _masked_mean(kl.detach(), mask)
        if cfg.entropy_coef > 0:
            # grad H = -E[grad log p(a) * log p(a)] over sampled a, so this surrogate descends -H
            surrogate = masked(logp.detach() * logp)
            total = total + cfg.entropy_coef * aggregate(surrogate, offsets, cfg.loss_agg, ctx, cfg.agg_norm, col_mask)
            metrics["entropy"] = _masked_mean(-logp.detach(), mask, empty=0.0)
        extra, extra_metrics = self._extra_loss(batch, mask, ctx)
        if extra is not None:
            total = total + extra
        metrics.update(extra_metrics)

        with torch.no_grad():
            outside = (ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)
            metrics.update(
                pg_loss=float(pg_loss.detach()),
                clip_fraction=_masked_mean(outside.to(logp.dtype), mask, empty=0.0),
                ratio_mean=_masked_mean(ratio, mask, empty=1.0),
                mismatch_kl=_masked_mean(old - logp, mask, empty=0.0),
                masked_fraction=float(1 - maskf.mean()) if mask.numel() else 0.0,
            )
            if cfg.correction is OffPolicyCorrection.DECOUPLED:
                metrics["is_weight_mean"] = _masked_mean(weight, mask, empty=1.0)
        return total, metrics

    def _extra_loss(
        self, batch: Batch, mask: torch.Tensor, ctx: LossContext
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Further loss terms (PPO's value loss); none by default."""
        return None, {}

    @abc.abstractmethod
    def compute_advantages(self, batch: Batch) -> Batch:  # pragma: no cover - abstract
        ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, empty: float = 0.0) -> float:
    n = int(mask.sum())
    return float(zero_masked(values, mask).sum() / n) if n else empty


def group_index(groups: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(group ids, inverse, counts)`` of a batch's ``group_id`` column; refuses groups of the wrong size."""
    uniq, inverse, counts = torch.unique(groups.to(torch.int64).reshape(-1), return_inverse=True, return_counts=True)
    if group_size is not None and bool((counts != group_size).any()):
        bad = uniq[counts != group_size][0]
        have = counts[counts != group_size][0]
        raise ValueError(
            f"group {int(bad)} has {int(have)} samples, expected group_size={group_size}; "
            "read groups with the group-complete sampler"
        )
    return uniq, inverse, counts


def equal_reward_rows(rewards: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Bool per row: every reward of the row's group is the same (dynamic sampling filters these)."""
    lo = torch.full((k,), float("inf")).scatter_reduce(0, inverse, rewards, "amin")
    hi = torch.full((k,), float("-inf")).scatter_reduce(0, inverse, rewards, "amax")
    return (hi - lo <= 0)[inverse]
