"""Conformance tests for Algorithm backends."""

from __future__ import annotations

import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import Algorithm, LossContext, OffPolicyCorrection
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


class AlgorithmSpec(BackendSpec):
    """Subclass and set ``backend``/``options``; ``sample_batch`` provides the columns built-ins use."""

    kind = PluginKind.ALGORITHM

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

    def test_loss_is_differentiable(self, make_backend):
        """The loss back-propagates into the log-probs it was given."""
        algo: Algorithm = make_backend()
        batch = algo.compute_advantages(sample_batch())
        values = batch[C.BEHAVIOR_LOGPROBS].values.clone().requires_grad_(True)
        loss, _ = algo.loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, LossContext(values.numel(), batch.num_rows, 0))
        loss.backward()
        assert values.grad is not None and bool(torch.isfinite(values.grad).all())
