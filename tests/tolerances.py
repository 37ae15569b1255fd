"""Tolerances for floats that two correct computations produce with their additions in different orders.

Thread counts, BLAS kernels, the CPU's vector width (``ATEN_CPU_CAPABILITY``)
and the way ranks split a batch all change the order in which a result is
summed, so two correct computations of one quantity differ by their rounding
errors. A test comparing them needs a tolerance of that size, derived from the
quantity: a fixed 1e-5 holds on one CPU and fails on the next.

Two bounds, both on a sum of ``n`` terms in any order, relative to the size of
its terms (``sum |x_i|``, or a bound on it) with ``u`` the unit roundoff:

- worst case (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
  ed., eq. 4.4): ``gamma_n = n u / (1 - n u)``; for short sums whose inputs a
  property test chooses;
- probabilistic (Higham & Mary, "A new approach to probabilistic rounding
  error analysis", SIAM J. Sci. Comput. 41(5), 2019): ``LAMBDA * sqrt(n) * u``
  with probability at least ``1 - 2n exp(-LAMBDA**2 / 2)``, i.e. ``1 - 3e-8 n``
  at ``LAMBDA = 6``; for long chains (a model's forward pass), where the worst
  case is far too loose to test anything.
"""

from __future__ import annotations

import math

import torch

#: Higham & Mary's lambda: the probabilistic bound fails with probability below 2n exp(-18) = 3e-8 n
LAMBDA = 6.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """The largest relative error of one rounding to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def rounding_tol(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of one quantity may differ when only the order of additions differs.

    ``terms`` is the number of additions on the quantity's longest path (a dot product's length, or the
    lengths along a chain of them) and ``magnitude`` the size of its terms. Each computation errs by at most
    ``LAMBDA * sqrt(terms) * u * magnitude`` (probabilistic bound), so their difference by twice that.
    """
    return 2 * LAMBDA * math.sqrt(max(terms, 1)) * unit_roundoff(dtype) * magnitude


def worst_case_tol(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of ``terms`` additions (and roundings), in any orders, may differ at most.

    ``magnitude`` is the sum of the terms' absolute values; each computation errs by at most
    ``gamma_n * magnitude`` with ``gamma_n = n u / (1 - n u)``, so their difference by twice that.
    """
    nu = max(terms, 1) * unit_roundoff(dtype)
    return 2 * nu / (1 - nu) * magnitude


def logprob_tol(logprobs: torch.Tensor, terms: int) -> float:
    """Log-probs from two computations of one model, ``terms`` additions deep (size: the log-softmax's)."""
    finite = logprobs[torch.isfinite(logprobs)]
    return rounding_tol(terms, float(finite.abs().max()) if finite.numel() else 0.0, logprobs.dtype)


def forward_terms(hf_config: dict, row_length: int) -> int:
    """Additions on the path from the input to one log-prob of a Llama/Qwen-style decoder (a Hugging Face config).

    Per layer: two RMSNorms, the q/k/v, attention-output and gate/up projections and the attention scores
    (``hidden_size`` each at most), the weighted values (``row_length``), the down projection
    (``intermediate_size``); then the final norm, the head and the log-softmax over the vocabulary.
    """
    h, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    return layers * (6 * h + hf_config["intermediate_size"] + row_length) + 2 * h + hf_config["vocab_size"]
