"""The built-in algorithms against hand-computed values, their masks and gradients, options, and the spec suite.

Every expected number below was worked out by hand from the formulas in
docs/algorithms.md; the comments show the arithmetic.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncflow_spec.algorithm as spec_algorithm
from asyncflow_core import columns as C
from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import LossContext, OffPolicyCorrection
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms import FILTERED, TRUNCATED, VALUE_PREDS
from asyncflow_plugins.algorithms.policy_loss import aggregate, discounted_cumsum, kl_estimate
from asyncflow_spec import AlgorithmSpec
from tolerances import worst_case_tol

LN2 = math.log(2.0)


def make(name: str, **options):
    return get_plugin_manager().create("algorithm", name, options)


def ragged(rows: list[list[float]], dtype=torch.float32) -> RaggedTensor:
    return RaggedTensor.from_sequences(rows, dtype=dtype)


def like(resp: RaggedTensor, values: list[float]) -> RaggedTensor:
    return RaggedTensor(torch.tensor(values, dtype=torch.float32), resp.offsets)


def ctx_for(batch: Batch) -> LossContext:
    return LossContext(batch[C.RESPONSE_IDS].numel_packed, batch.num_rows, 0)


def approx(values) -> object:
    return pytest.approx(values, abs=1e-6)


# ------------------------------------------------------------------------------------------ advantages


def group_batch() -> Batch:
    """Two groups: rewards (1, 0) and (2, 4); response lengths 2, 1, 3, 1."""
    return Batch(
        {
            C.RESPONSE_IDS: RaggedTensor.from_sequences([[1, 2], [3], [4, 5, 6], [7]]),
            C.REWARD: torch.tensor([1.0, 0.0, 2.0, 4.0]),
            C.GROUP_ID: torch.tensor([0, 0, 1, 1]),
        }
    )


def test_grpo_group_std_advantages():
    # group 0: mean .5, unbiased std sqrt(.5) -> +-.5/.70711 = +-.70711; group 1: mean 3, std sqrt(2) -> -+.70711
    adv = make("grpo", eps=1e-12).compute_advantages(group_batch())[C.ADVANTAGES]
    s = 0.5**0.5
    assert adv.values.tolist() == approx([s, s, -s, -s, -s, -s, s])


def test_grpo_dr_grpo_no_std_and_old_spelling_agree():
    # centred only: (1 - .5, 0 - .5, 2 - 3, 4 - 3) per row, broadcast over lengths 2, 1, 3, 1
    want = [0.5, 0.5, -0.5, -1.0, -1.0, -1.0, 1.0]
    assert make("grpo", scale_rewards="none").compute_advantages(group_batch())[C.ADVANTAGES].values.tolist() == want
    assert make("grpo", normalize_std=False).compute_advantages(group_batch())[C.ADVANTAGES].values.tolist() == want


def test_grpo_batch_std_advantages():
    # batch std of (1, 0, 2, 4): mean 1.75, squares .5625 + 3.0625 + .0625 + 5.0625 = 8.75, / 3 -> std 1.7078251
    # advantages (.5, -.5, -1, 1) / 1.7078251 = (.2927700, -.2927700, -.5855400, .5855400)
    algo = make("grpo", scale_rewards="batch", eps=1e-12)
    adv = algo.compute_advantages(group_batch())[C.ADVANTAGES].values.tolist()
    a, b = 0.29277002, 0.58554004
    assert adv == approx([a, a, -a, -b, -b, -b, b])
    assert algo.advantage_scope == "step"
    assert make("grpo").advantage_scope == "group"


def test_rloo_leave_one_out_advantages():
    # group 0 rewards (1, 0, 2): 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5; group 1 (3, 5): -2, 2
    batch = Batch(
        {
            C.RESPONSE_IDS: RaggedTensor.from_sequences([[1], [2, 3], [4], [5], [6]]),
            C.REWARD: torch.tensor([1.0, 0.0, 2.0, 3.0, 5.0]),
            C.GROUP_ID: torch.tensor([0, 0, 0, 1, 1]),
        }
    )
    adv = make("rloo").compute_advantages(batch)[C.ADVANTAGES]
    assert adv.values.tolist() == approx([0.0, -1.5, -1.5, 1.5, -2.0, 2.0])


def test_rloo_refuses_a_group_of_one():
    batch = Batch({C.RESPONSE_IDS: RaggedTensor.from_sequences([[1], [2], [3]]), C.REWARD: torch.zeros(3),
                   C.GROUP_ID: torch.tensor([0, 0, 1])})
    with pytest.raises(ValueError, match="group 1 has 1 sample: the leave-one-out baseline needs at least 2"):
        make("rloo").compute_advantages(batch)


def test_dynamic_sampling_marks_groups_with_equal_rewards():
    # group 0 rewards (1, 1): no signal -> filtered, advantages 0; group 1 (0, 1) kept
    batch = Batch({C.RESPONSE_IDS: RaggedTensor.from_sequences([[1], [2], [3], [4]]),
                   C.REWARD: torch.tensor([1.0, 1.0, 0.0, 1.0]), C.GROUP_ID: torch.tensor([0, 0, 1, 1])})
    for name in ("grpo", "rloo"):
        out = make(name, dynamic_sampling=True).compute_advantages(batch)
        assert out[FILTERED].tolist() == [True, True, False, False]
        assert out[C.ADVANTAGES].values[:2].tolist() == [0.0, 0.0]
    assert FILTERED not in make("grpo").compute_advantages(batch)


def test_overlong_soft_punishment():
    # L = 4, buffer 2: lengths (1, 3, 4, 2) exceed L - 2 = 2 by (0, 1, 2, 0) -> penalties (0, .5, 1, 0)
    # shaped rewards (1, .5, 0, 1), one group, mean .625 -> no-std advantages (.375, -.125, -.625, .375)
    batch = Batch({C.RESPONSE_IDS: RaggedTensor.from_sequences([[1], [1, 2, 3], [1, 2, 3, 4], [1, 2]]),
                   C.REWARD: torch.ones(4), C.GROUP_ID: torch.zeros(4, dtype=torch.int64)})
    algo = make("grpo", scale_rewards="none", max_response_length=4, overlong_buffer=2)
    assert algo.shaped_rewards(batch).tolist() == approx([1.0, 0.5, 0.0, 1.0])
    adv = algo.compute_advantages(batch)[C.ADVANTAGES]
    assert adv.values.tolist() == approx([0.375] + [-0.125] * 3 + [-0.625] * 4 + [0.375] * 2)


def test_reinforce_pp_returns_with_kl_in_reward_and_batch_normalisation():
    # k1 penalty per token = behavior - ref = (ln2, 0, -ln2), coef .1
    # row 0 (R=1): token rewards (-.1 ln2, 1) -> returns (1 - .1 ln2, 1) = (.9306853, 1)
    # row 1 (R=0): token reward (+.1 ln2)     -> return .0693147
    # mean 2/3, unbiased std .5184816 -> (.5092150, .6429029, -1.1521180)
    resp = RaggedTensor.from_sequences([[1, 2], [3]])
    batch = Batch({
        C.RESPONSE_IDS: resp, C.REWARD: torch.tensor([1.0, 0.0]), C.GROUP_ID: torch.tensor([0, 0]),
        C.BEHAVIOR_LOGPROBS: like(resp, [math.log(0.5)] * 3),
        C.REF_LOGPROBS: like(resp, [math.log(0.25), math.log(0.5), 0.0]),
    })
    raw = make("reinforce_pp", kl_in_reward_coef=0.1, normalize_advantages=False).compute_advantages(batch)
    assert raw[C.ADVANTAGES].values.tolist() == approx([1 - 0.1 * LN2, 1.0, 0.1 * LN2])
    algo = make("reinforce_pp", kl_in_reward_coef=0.1, eps=1e-12)
    assert algo.compute_advantages(batch)[C.ADVANTAGES].values.tolist() == approx([0.5092150, 0.6429029, -1.1521180])
    assert algo.advantage_scope == "step"
    assert C.REF_LOGPROBS in algo.required_columns


def test_reinforce_pp_discount_and_group_baseline():
    # gamma .5, no KL: row 0 (R=1) returns (.5, 1), row 1 (R=0) return 0
    # group_mean baseline: rewards (1, 0) -> (.5, -.5): returns (.25, .5) and (-.5)
    resp = RaggedTensor.from_sequences([[1, 2], [3]])
    batch = Batch({C.RESPONSE_IDS: resp, C.REWARD: torch.tensor([1.0, 0.0]), C.GROUP_ID: torch.tensor([7, 7]),
                   C.BEHAVIOR_LOGPROBS: like(resp, [0.0] * 3)})
    plain = make("reinforce_pp", gamma=0.5, normalize_advantages=False)
    assert plain.compute_advantages(batch)[C.ADVANTAGES].values.tolist() == approx([0.5, 1.0, 0.0])
    base = make("reinforce_pp", gamma=0.5, normalize_advantages=False, baseline="group_mean")
    assert base.compute_advantages(batch)[C.ADVANTAGES].values.tolist() == approx([0.25, 0.5, -0.5])
    assert C.GROUP_ID in base.required_columns and C.GROUP_ID not in plain.required_columns


def ppo_batch() -> Batch:
    resp = RaggedTensor.from_sequences([[1, 2, 3], [4]])
    return Batch({
        C.RESPONSE_IDS: resp, C.REWARD: torch.tensor([1.0, 0.0]), C.GROUP_ID: torch.tensor([0, 0]),
        C.BEHAVIOR_LOGPROBS: like(resp, [-1.0] * 4), C.VALUES: like(resp, [0.5, 0.4, 0.2, 0.3]),
    })


def test_ppo_gae_by_hand():
    # row 0, gamma .9, lam .8, V = (.5, .4, .2), R = 1 on the last token:
    #   delta2 = 1 + 0 - .2 = .8 ; delta1 = .9*.2 - .4 = -.22 ; delta0 = .9*.4 - .5 = -.14
    #   A2 = .8 ; A1 = -.22 + .72*.8 = .356 ; A0 = -.14 + .72*.356 = .11632 ; returns A + V = (.61632, .756, 1)
    # row 1, V = .3, R = 0: delta = -.3 = A ; return 0
    algo = make("ppo", gamma=0.9, lam=0.8, whiten_advantages=False)
    out = algo.compute_advantages(ppo_batch())
    assert out[C.ADVANTAGES].values.tolist() == approx([0.11632, 0.356, 0.8, -0.3])
    assert out[C.RETURNS].values.tolist() == approx([0.61632, 0.756, 1.0, 0.0])
    assert algo.advantage_scope == "group"
    white = make("ppo", gamma=0.9, lam=0.8).compute_advantages(ppo_batch())
    assert white[C.RETURNS].values.tolist() == approx([0.61632, 0.756, 1.0, 0.0])  # returns stay raw
    assert float(white[C.ADVANTAGES].values.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(white[C.ADVANTAGES].values.std()) == pytest.approx(1.0, abs=1e-5)
    assert C.VALUES in algo.required_columns and C.GROUP_ID not in algo.required_columns


def test_ppo_lambda_one_is_monte_carlo_returns_minus_values():
    # lam = gamma = 1: A_t = R - V_t -> row 0: (.5, .6, .8), row 1: -.3
    out = make("ppo", gamma=1.0, lam=1.0, whiten_advantages=False).compute_advantages(ppo_batch())
    assert out[C.ADVANTAGES].values.tolist() == approx([0.5, 0.6, 0.8, -0.3])


def test_discounted_cumsum_respects_rows():
    offsets = torch.tensor([0, 2, 2, 5])
    got = discounted_cumsum(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), offsets, 0.5)
    # row 0: (1 + .5*2, 2) ; empty row ; row 2: (3 + .5*4 + .25*5, 4 + .5*5, 5)
    assert got.tolist() == approx([2.0, 2.0, 6.25, 6.5, 5.0])


# ----------------------------------------------------------------------------------------------- losses


def loss_batch(adv: list[float], behavior: list[float], rows: list[list[int]] | None = None, **extra) -> Batch:
    resp = RaggedTensor.from_sequences(rows or [[1, 2], [3]])
    cols = {C.RESPONSE_IDS: resp, C.ADVANTAGES: like(resp, adv), C.BEHAVIOR_LOGPROBS: like(resp, behavior),
            C.REWARD: torch.zeros(len(resp)), C.GROUP_ID: torch.zeros(len(resp), dtype=torch.int64)}
    cols.update({k: like(resp, v) if isinstance(v, list) else v for k, v in extra.items()})
    return Batch(cols)


@pytest.mark.parametrize(
    ("loss_agg", "options", "want"),
    [
        # per-token losses -A = (-1, -3, 2) at ratio 1; sequences (tokens 0-1) and (token 2)
        ("token-mean", {}, (-1 - 3 + 2) / 3),  # -2/3
        ("seq-mean-token-mean", {}, ((-1 - 3) / 2 + 2) / 2),  # 0
        ("seq-mean-token-sum-norm", {"loss_agg_norm": 4}, (-1 - 3 + 2) / (2 * 4)),  # -.25
        ("seq-mean-token-sum-norm", {"max_response_length": 8}, (-1 - 3 + 2) / (2 * 8)),  # norm defaults to L
    ],
)
def test_loss_aggregation_by_hand(loss_agg, options, want):
    algo = make("grpo", correction="none", loss_agg=loss_agg, **options)
    batch = loss_batch([1.0, 3.0, -2.0], [-0.5, -0.5, -0.5])
    logp = like(batch[C.RESPONSE_IDS], [-0.5, -0.5, -0.5])
    loss, metrics = algo.loss(logp, batch, ctx_for(batch))
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(want, abs=1e-6)


def test_truncated_is_caps_the_ratio_against_behavior():
    # ratio .9/.3 = 3 -> capped at 2. A = +1: min(2, 1.2) = 1.2 -> -1.2 ; A = -1: min(-2, -1.2) = -2 -> +2
    # token-mean over 2 tokens: (-1.2 + 2) / 2 = .4 ; the capped ratio is a constant: no gradient on either token
    resp = [[1], [2]]
    batch = loss_batch([1.0, -1.0], [math.log(0.3)] * 2, rows=resp)
    values = torch.tensor([math.log(0.9)] * 2, requires_grad=True)
    loss, metrics = make("grpo").loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(0.4, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(2.0)
    loss.backward()
    assert values.grad.tolist() == approx([0.0, 0.0])


def test_decoupled_clips_against_old_and_weights_behavior_to_old():
    # token 0: behavior .25, old .5, new .55: weight min(.5/.25, 1.5) = 1.5, ratio 1.1 (inside), A = 1 -> -1.65
    # token 1: behavior .5, old .4, new .2: weight .8, ratio .5, A = -1: min(-.5, -.8) = -.8 (clipped) -> +.64
    # token-mean (-1.65 + .64) / 2 = -.505 ; grad on token 0: d(-1.5 * exp(logp - log .5)) / 2 = -1.5*1.1/2 = -.825
    resp = [[1], [2]]
    batch = loss_batch([1.0, -1.0], [math.log(0.25), math.log(0.5)], rows=resp,
                       **{C.OLD_LOGPROBS: [math.log(0.5), math.log(0.4)]})
    algo = make("grpo", correction="decoupled", is_cap=1.5)
    values = torch.tensor([math.log(0.55), math.log(0.2)], requires_grad=True)
    loss, metrics = algo.loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(-0.505, abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx((1.5 + 0.8) / 2)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    assert values.grad.tolist() == approx([-0.825, 0.0])
    assert algo.required_columns == (C.REWARD, C.GROUP_ID, C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS)


def test_kl_estimators_by_hand():
    # p = .5, p_ref = .25: d = ln(.25/.5) = -ln2 ; k1 = ln2, k2 = ln2^2 / 2, k3 = .5 + ln2 - 1
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(LN2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * LN2 * LN2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + LN2 - 1)
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-1e4]), "k3").isfinite().all()


@pytest.mark.parametrize(("estimator", "kl", "grad"), [
    # the same token; zero advantage so only the KL term is left; coef .1, one token
    ("k1", LN2, 1.0),  # d k1 / d logp = 1
    ("k2", 0.5 * LN2 * LN2, LN2),  # d k2 / d logp = logp - ref = ln2
    ("k3", 0.5 + LN2 - 1, 0.5),  # d k3 / d logp = 1 - exp(ref - logp) = 1 - .5
])
def test_kl_term_in_the_loss(estimator, kl, grad):
    batch = loss_batch([0.0], [math.log(0.5)], rows=[[1]], **{C.REF_LOGPROBS: [math.log(0.25)]})
    algo = make("grpo", correction="none", kl_coef=0.1, kl_estimator=estimator)
    assert C.REF_LOGPROBS in algo.required_columns
    values = torch.tensor([math.log(0.5)], requires_grad=True)
    loss, metrics = algo.loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(0.1 * kl, abs=1e-6)
    assert metrics["kl"] == pytest.approx(kl, abs=1e-6)
    loss.backward()
    assert values.grad.item() == pytest.approx(0.1 * grad, abs=1e-6)


def test_entropy_bonus_by_hand():
    # one row of two tokens, zero advantage: only the bonus is left. coef .1, token-mean over 2 tokens:
    # loss = .1 * ((-1)(-1) + (-2)(-2)) / 2 = .25 ; d/dlogp = .1 * logp.detach() / 2 = [-.05, -.1]
    # (descending it raises -logp of the sampled tokens, i.e. the entropy estimate) ; metric: mean(-logp) = 1.5
    batch = loss_batch([0.0, 0.0], [-1.0, -2.0], rows=[[1, 2]])
    algo = make("grpo", correction="none", entropy_coef=0.1)
    values = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, metrics = algo.loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(0.25, abs=1e-6)
    assert metrics["entropy"] == pytest.approx(1.5)
    loss.backward()
    assert values.grad.tolist() == approx([-0.05, -0.1])


def test_overlong_filter_masks_truncated_samples():
    # max length 2: row 0 (2 tokens) is truncated and masked; row 1 (1 token, A = 1, ratio 1) gives -1
    # token-mean still divides by the step's 3 tokens: -1/3 ; no gradient reaches the masked tokens
    batch = loss_batch([5.0, 5.0, 1.0], [-1.0, -1.0, -1.0])
    algo = make("grpo", correction="none", overlong_filter=True, max_response_length=2)
    values = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    loss, metrics = algo.loss(RaggedTensor(values, batch[C.RESPONSE_IDS].offsets), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-6)
    assert metrics["masked_fraction"] == pytest.approx(2 / 3)
    loss.backward()
    assert values.grad.tolist() == approx([0.0, 0.0, -1 / 3])


def test_overlong_filter_from_a_truncated_column():
    algo = make("grpo", correction="none", overlong_filter=True, truncation_signal="column")
    assert TRUNCATED in algo.required_columns
    batch = loss_batch([5.0, 5.0, 1.0], [-1.0] * 3, **{TRUNCATED: torch.tensor([False, True])})
    loss, _ = algo.loss(like(batch[C.RESPONSE_IDS], [-1.0] * 3), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(-10 / 3, abs=1e-6)  # row 0 kept: -(5 + 5) / 3


def test_gradient_reaches_only_the_current_logprobs():
    """Advantages, behavior, old and reference log-probs are data: the loss never differentiates through them."""
    resp = RaggedTensor.from_sequences([[1, 2], [3]])
    leaves = {name: torch.tensor([-0.7, -0.2, -1.1], requires_grad=True)
              for name in (C.ADVANTAGES, C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS)}
    batch = Batch({C.RESPONSE_IDS: resp, C.REWARD: torch.zeros(2), C.GROUP_ID: torch.zeros(2, dtype=torch.int64),
                   **{k: RaggedTensor(v, resp.offsets) for k, v in leaves.items()}})
    values = torch.tensor([-0.5, -0.3, -0.9], requires_grad=True)
    for correction in ("none", "truncated_is", "decoupled"):
        algo = make("grpo", correction=correction, kl_coef=0.2)
        loss, _ = algo.loss(RaggedTensor(values, resp.offsets), batch, ctx_for(batch))
        loss.backward()
    assert values.grad is not None and bool((values.grad != 0).all())
    assert all(leaf.grad is None for leaf in leaves.values())


def test_ppo_value_loss_by_hand():
    # token 0: V_old .5, pred .9, G 1: clipped pred .7 ; max((.9-1)^2, (.7-1)^2) = .09 -> .045 (clipped: no grad)
    # token 1: V_old .5, pred .6, G 0: inside the clip ; .36 -> .18 ; grad .5 * 2 * .6 / 2 tokens = .3
    # token-mean (.045 + .18) / 2 = .1125 ; times value_coef .5 = .05625 (zero advantages: no policy loss)
    resp = RaggedTensor.from_sequences([[1, 2]])
    preds = torch.tensor([0.9, 0.6], requires_grad=True)
    batch = Batch({C.RESPONSE_IDS: resp, C.REWARD: torch.zeros(1), C.ADVANTAGES: like(resp, [0.0, 0.0]),
                   C.BEHAVIOR_LOGPROBS: like(resp, [-1.0, -1.0]), C.VALUES: like(resp, [0.5, 0.5]),
                   C.RETURNS: like(resp, [1.0, 0.0]), VALUE_PREDS: RaggedTensor(preds, resp.offsets)})
    algo = make("ppo", value_coef=0.5, value_clip=0.2)
    loss, metrics = algo.loss(like(resp, [-1.0, -1.0]), batch, ctx_for(batch))
    assert loss.item() == pytest.approx(0.05625, abs=1e-6)
    assert metrics["value_loss"] == pytest.approx(0.1125, abs=1e-6)
    assert metrics["value_clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    assert preds.grad.tolist() == approx([0.0, 0.15])  # value_coef .5 * .3


def test_ppo_value_loss_recomputes_returns_when_the_column_is_gone():
    """The runtime's advantage stage stores only advantages; the loss then rebuilds the same GAE returns."""
    algo = make("ppo", gamma=0.9, lam=0.8)
    full = algo.compute_advantages(ppo_batch())
    preds = RaggedTensor(torch.tensor([0.1, 0.2, 0.3, 0.4]), full[C.RESPONSE_IDS].offsets)
    with_returns = full.with_columns(**{VALUE_PREDS: preds})
    without = Batch({k: v for k, v in with_returns.items() if k != C.RETURNS})
    logp = full[C.BEHAVIOR_LOGPROBS]
    a, _ = algo.loss(logp, with_returns, ctx_for(full))
    b, _ = algo.loss(logp, without, ctx_for(full))
    assert a.item() == pytest.approx(b.item(), abs=1e-6)


def test_ppo_without_value_predictions_says_what_to_do():
    algo = make("ppo")
    batch = algo.compute_advantages(ppo_batch())
    with pytest.raises(ValueError, match="value_preds.*value_coef=0"):
        algo.loss(batch[C.BEHAVIOR_LOGPROBS], batch, ctx_for(batch))
    loss, metrics = make("ppo", value_coef=0).loss(batch[C.BEHAVIOR_LOGPROBS], batch, ctx_for(batch))
    assert "value_loss" not in metrics and torch.isfinite(loss)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=2, max_size=8),
    cut=st.integers(1, 7),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
)
def test_aggregation_adds_up_over_any_split(lengths, cut, loss_agg):
    cut = min(cut, len(lengths) - 1)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    losses = torch.arange(int(offsets[-1]), dtype=torch.float32) * 0.37 - 1.0
    ctx = LossContext(int(offsets[-1]), len(lengths), 0)
    whole = aggregate(losses, offsets, loss_agg, ctx, 6)
    mid = int(offsets[cut])
    parts = aggregate(losses[:mid], offsets[: cut + 1], loss_agg, ctx, 6) + aggregate(
        losses[mid:], offsets[cut:] - mid, loss_agg, ctx, 6)
    # both are one combination of the losses with non-negative weights, summed in different orders: they differ
    # by at most twice gamma_n times the combination of |losses| (n additions, then a division or two and a sum)
    size = aggregate(losses.abs(), offsets, loss_agg, ctx, 6).item()
    assert whole.item() == pytest.approx(parts.item(), abs=worst_case_tol(losses.numel() + 4, size))


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("grpo", {"clip_low": 1.0}, "clip_low must be < 1"),
        ("grpo", {"loss_agg": "seq-mean-token-sum-norm"}, "set loss_agg_norm"),
        ("grpo", {"overlong_filter": True}, "needs max_response_length"),
        ("grpo", {"overlong_buffer": 4}, "overlong_buffer needs max_response_length"),
        ("grpo", {"overlong_buffer": 8, "max_response_length": 8}, "must be smaller than max_response_length=8"),
        ("grpo", {"normalize_std": True, "scale_rewards": "none"}, "contradicts scale_rewards"),
        ("grpo", {"dynamic_sampling": True, "group_size": 1}, "would filter every group"),
        ("grpo", {"kl_estimator": "k4"}, "kl_estimator"),
        ("grpo", {"clip_ratio": 0.2}, "clip_ratio"),
        ("rloo", {"group_size": 1}, "rloo needs group_size >= 2"),
        ("ppo", {"lam": 1.5}, "lam"),
        ("ppo", {"dynamic_sampling": True}, "dynamic_sampling"),
        ("reinforce_pp", {"baseline": "median"}, "baseline"),
    ],
)
def test_impossible_options_are_refused_with_a_fix(name, options, message):
    with pytest.raises(ConfigError, match=message):
        make(name, **options)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "ppo"])
def test_every_option_is_described_and_documented(name):
    model = get_plugin_manager().lookup("algorithm", name).record.config_model
    docs = (Path(__file__).parents[1] / "docs" / "algorithms.md").read_text()
    assert model.model_config.get("extra") == "forbid"
    assert f"## `{name}`" in docs
    for field_name, field in model.model_fields.items():
        assert field.description, f"{name}.{field_name} has no description"
        assert f"`{field_name}`" in docs, f"docs/algorithms.md does not mention {name}.{field_name}"


def test_required_columns_follow_the_options():
    assert make("grpo").required_columns == (C.REWARD, C.GROUP_ID, C.BEHAVIOR_LOGPROBS)
    assert make("ppo", kl_coef=0.1, correction="decoupled").required_columns == (
        C.REWARD, C.VALUES, C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS)
    assert make("reinforce_pp").correction is OffPolicyCorrection.TRUNCATED_IS


# ----------------------------------------------------------------------------------- conformance suite


class TestGRPODAPO(AlgorithmSpec):
    backend = "grpo"
    options = {"clip_high": 0.28, "dynamic_sampling": True, "overlong_filter": True, "max_response_length": 4,
               "overlong_buffer": 1}


class TestGRPODr(AlgorithmSpec):
    backend = "grpo"
    options = {"scale_rewards": "none", "loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm": 8}


class TestGRPOSeqMeanKL(AlgorithmSpec):
    backend = "grpo"
    options = {"loss_agg": "seq-mean-token-mean", "kl_coef": 0.05, "kl_estimator": "k3", "scale_rewards": "batch"}


class TestRLOO(AlgorithmSpec):
    backend = "rloo"


class TestRLOODecoupled(AlgorithmSpec):
    backend = "rloo"
    options = {"correction": "decoupled", "kl_coef": 0.1, "kl_estimator": "k2"}


class TestReinforcePP(AlgorithmSpec):
    backend = "reinforce_pp"


class TestReinforcePPBaselineKL(AlgorithmSpec):
    backend = "reinforce_pp"
    options = {"baseline": "group_mean", "kl_in_reward_coef": 0.05, "kl_coef": 0.01, "gamma": 0.99,
               "loss_agg": "seq-mean-token-mean"}


class _WithValues:
    """The spec's batch lacks value columns; add old estimates and (detached) head predictions for PPO."""

    @pytest.fixture(autouse=True)
    def _values(self, monkeypatch):
        original = spec_algorithm.sample_batch

        def with_values(*args, **kwargs) -> Batch:
            batch = original(*args, **kwargs)
            resp = batch[C.RESPONSE_IDS]
            ramp = torch.linspace(0.1, 0.9, resp.numel_packed)
            return batch.with_columns(**{C.VALUES: RaggedTensor(ramp, resp.offsets),
                                         VALUE_PREDS: RaggedTensor(ramp.flip(0), resp.offsets)})

        monkeypatch.setattr(spec_algorithm, "sample_batch", with_values)


class TestPPO(_WithValues, AlgorithmSpec):
    backend = "ppo"


class TestPPOPolicyOnlyDecoupled(_WithValues, AlgorithmSpec):
    backend = "ppo"
    options = {"value_coef": 0.0, "correction": "decoupled", "kl_in_reward_coef": 0.1, "whiten_advantages": False}


def test_the_suite_fails_an_algorithm_that_reads_other_groups_but_declares_group_scope():
    """A GRPO that normalises over the batch (``scale_rewards: batch``) yet claims ``advantage_scope`` ``group``
    would give a group different advantages depending on which groups finished with it: the spec must say so."""
    honest = make("grpo", scale_rewards="batch")
    assert honest.advantage_scope == "step"

    class ClaimsGroup(type(honest)):
        @property
        def advantage_scope(self):
            return "group"

    lying = ClaimsGroup(honest.config)
    with pytest.raises(AssertionError, match="declares advantage_scope 'group'"):
        AlgorithmSpec().test_group_scoped_advantages_depend_on_their_group_alone(lambda: lying)
