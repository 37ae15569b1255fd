"""Conformance tests for Algorithm backends."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import Algorithm, LossContext, OffPolicyCorrection
from asyncflow_core.interfaces.features import algorithm_features
from asyncflow_core.plugins import PluginKind
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_spec.base import BackendSpec


def sample_batch(rows: int = 6, group: int = 3) -> Batch:
    gen = torch.Generator().manual_seed(0)
    lengths = [2 + i % 3 for i in range(rows)]
    resp = RaggedTensor.from_sequences([torch.randint(0, 10, (n,), generator=gen) for n in lengths])
    behavior = RaggedTensor(-torch.rand(resp.numel_packed, generator=gen), resp.offsets)
    return Batch(
        {
            C.PROMPT_IDS: RaggedTensor.from_sequences([[1, 2]] * rows),
            C.RESPONSE_IDS: resp,
            C.REWARD: torch.rand(rows, generator=gen),
            C.GROUP_ID: torch.arange(rows) // group,
            C.BEHAVIOR_LOGPROBS: behavior,
            C.OLD_LOGPROBS: behavior,
            C.REF_LOGPROBS: behavior,
        }
    )


def with_loss_mask(batch: Batch) -> Batch:
    """``batch`` with a ``loss_mask`` column masking every second response token of each row (the first kept)."""
    resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
    within = torch.arange(resp.numel_packed) - torch.repeat_interleave(resp.offsets[:-1], resp.lengths)
    return batch.with_columns(**{C.LOSS_MASK: RaggedTensor(within % 2 == 0, resp.offsets)})


LOSS_MASK_HELP = (
    "batches of multi-turn episodes carry a `loss_mask` column (asyncflow_core.columns.LOSS_MASK, ragged bool/uint8 "
    "aligned with response_ids): a token with mask 0 (prompt, observation, tool output) must contribute nothing. "
    "Read it with LossContext.token_mask(batch), cut masked log-probs from the graph "
    "(torch.where(mask, logp, logp.detach())), zero their per-token losses with torch.where, and normalise by "
    "ctx.global_tokens, which counts unmasked tokens only; or subclass "
    "asyncflow_plugins.algorithms.PolicyGradientAlgorithm, which does all of this. Until then set "
    "`predates_loss_mask = True` in this spec class (the check then xfails) and refuse batches that have the column"
)


class AlgorithmSpec(BackendSpec):
    """Subclass and set ``backend``/``options``; ``sample_batch`` provides the columns built-ins use.

    ``predates_loss_mask``: set it to ``True`` while the algorithm does not
    yet honour the ``loss_mask`` column; the mask check then xfails with what
    to change (and fails once the algorithm honours the mask, so the flag
    is removed).
    """

    kind = PluginKind.ALGORITHM
    predates_loss_mask: ClassVar[bool] = False

    def test_declares_columns_and_correction(self, make_backend):
        """``required_columns`` is a tuple of names and ``correction`` an OffPolicyCorrection."""
        algo: Algorithm = make_backend()
        assert isinstance(algo.required_columns, tuple) and all(isinstance(c, str) for c in algo.required_columns)
        assert isinstance(algo.correction, OffPolicyCorrection)

    def test_advantages_aligned_with_responses(self, make_backend):
        """``compute_advantages`` adds a ragged float ``advantages`` column with the offsets of ``response_ids``."""
        algo: Algorithm = make_backend()
        batch = sample_batch()
        out = algo.compute_advantages(batch)
        adv = out[C.ADVANTAGES]
        assert isinstance(adv, RaggedTensor)
        assert torch.equal(adv.offsets, batch[C.RESPONSE_IDS].offsets)
        assert adv.values.is_floating_point() and bool(torch.isfinite(adv.values).all())

    def test_micro_batch_losses_add_up_to_the_full_batch(self, make_backend):
        """Summed micro-batch losses (normalised by LossContext) equal the loss of the whole batch."""
        algo: Algorithm = make_backend()
        batch = algo.compute_advantages(sample_batch())
        logp_full = RaggedTensor(batch[C.BEHAVIOR_LOGPROBS].values + 0.05, batch[C.RESPONSE_IDS].offsets)
        ctx = LossContext(batch[C.RESPONSE_IDS].numel_packed, batch.num_rows, 0)
        whole, _ = algo.loss(logp_full, batch, ctx)
        parts = torch.tensor(0.0, dtype=torch.float64)
        magnitude = 0.0
        for idx in (torch.arange(0, 2), torch.arange(2, 6)):
            mb = batch.select(idx)
            lp = RaggedTensor(mb[C.BEHAVIOR_LOGPROBS].values + 0.05, mb[C.RESPONSE_IDS].offsets)
            loss, metrics = algo.loss(lp, mb, ctx)
            assert all(isinstance(v, float) for v in metrics.values())
            parts = parts + loss.double()
            magnitude += abs(float(loss))
        # the two sides sum the same per-token terms in a different order: their float difference is bounded by
        # (terms summed) x unit roundoff x the size of the sums (Higham's summation bound), with slack for the
        # few extra operations per term; a wrong normalisation is off by a whole factor, far above this
        n_terms = batch[C.RESPONSE_IDS].numel_packed + batch.num_rows
        tol = 4 * n_terms * torch.finfo(whole.dtype).eps * max(magnitude, abs(float(whole)), 1e-3)
        assert abs(float(whole) - float(parts)) <= tol, (float(whole), float(parts), tol)

    def test_group_scoped_advantages_depend_on_their_group_alone(self, make_backend):
        """``advantage_scope`` ``group``: a group's advantages are the same whether the group comes alone or with
        others. The advantage stage hands such an algorithm whichever whole groups are ready, so an estimator
        that reads other groups (a batch-wide std, say) must declare ``step``, or its advantages would depend
        on which groups happened to finish together."""
        algo: Algorithm = make_backend()
        scope = algorithm_features(algo).advantage_scope
        if scope != "group":
            pytest.skip(f"advantage_scope is {scope!r}: the train stage calls compute_advantages on the whole step")
        batch = sample_batch(rows=9, group=3)
        together = algo.compute_advantages(batch)[C.ADVANTAGES]
        gids = batch[C.GROUP_ID]
        for g in gids.unique().tolist():
            idx = (gids == g).nonzero().squeeze(1)
            alone = algo.compute_advantages(batch.select(idx))[C.ADVANTAGES]
            mine = together.values[torch.cat([torch.arange(int(together.offsets[i]), int(together.offsets[i + 1]))
                                              for i in idx.tolist()])]
            # the same arithmetic over the same rows, summed in another order at most: a few roundings of the
            # advantages' size; reading another group moves them by a whole share of that group's rewards
            scale = max(float(alone.values.abs().max()), 1.0)
            tol = 8 * torch.finfo(torch.float32).eps * scale
            diff = float((alone.values - mine).abs().max()) if mine.numel() else 0.0
            assert diff <= tol, (
                f"group {g}'s advantages change by {diff:.3g} when other groups are in the batch, yet "
                f"{type(algo).__name__} declares advantage_scope 'group'; declare 'step' (AlgorithmFeatures) if it "
                "normalises over more than one group")

    def test_loss_is_differentiable(self, make_backend):
        """The loss back-propagates into the log-probs it was given."""
        algo: Algorithm = make_backend()
        batch = algo.compute_advantages(sample_batch())
        values = batch[C.BEHAVIOR_LOGPROBS].values.clone().requires_grad_(True)
        loss, _ = algo.loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, LossContext(values.numel(), batch.num_rows, 0))
        loss.backward()
        assert values.grad is not None and bool(torch.isfinite(values.grad).all())

    def test_masked_tokens_contribute_nothing(self, make_backend):
        """With a ``loss_mask`` column, masked tokens' log-probs get exactly zero gradient and cannot move the loss."""
        algo: Algorithm = make_backend()
        batch = algo.compute_advantages(with_loss_mask(sample_batch()))
        offsets = batch[C.RESPONSE_IDS].offsets
        keep = batch[C.LOSS_MASK].values
        ctx = LossContext.of(batch, 0)
        values = (batch[C.BEHAVIOR_LOGPROBS].values + 0.05).clone().requires_grad_(True)
        loss, _ = algo.loss(RaggedTensor(values, offsets), batch, ctx)
        loss.backward()
        problems = []
        assert values.grad is not None, "the loss does not back-propagate into the log-probs"
        leaked = int((values.grad[~keep] != 0).sum())
        if leaked:
            problems.append(f"{leaked} of {int((~keep).sum())} masked tokens got a non-zero gradient")
        # the masked tokens' log-probs far from where they were: not one bit of the loss may change
        moved = torch.where(keep, values.detach(), values.detach() - 3.0)
        with torch.no_grad():
            moved_loss, _ = algo.loss(RaggedTensor(moved, offsets), batch, ctx)
        was, now = float(loss.detach()), float(moved_loss)
        if now != was:
            problems.append(f"the loss changes ({was} -> {now}) when only masked tokens' log-probs change")
        if self.predates_loss_mask:
            if not problems:
                pytest.fail(f"{type(algo).__name__} honours loss_mask now: remove `predates_loss_mask = True` from "
                            f"{type(self).__name__}")
            pytest.xfail(f"{type(algo).__name__} predates loss_mask ({'; '.join(problems)}): {LOSS_MASK_HELP}")
        assert not problems, f"{type(algo).__name__} ignores loss_mask ({'; '.join(problems)}): {LOSS_MASK_HELP}"
