"""The ``loss_mask`` column: masked tokens contribute exactly nothing to any built-in algorithm's loss, and the
trainers' token counts (``LossContext.global_tokens``) count only unmasked tokens.

Each masked token's inputs (behaviour, old and reference log-probs, values) are NaN and its current log-prob
is -inf, as a tool token's may be: the loss must stay finite and its gradient on them exactly zero.

The trainers: the toy and fsdp engines count only unmasked tokens and take no step on a fully masked batch;
the megatron engine (CPU, slow-marked) takes bit for bit the same step whatever a masked token's inputs hold.
The fsdp engine on partially masked episodes, PPO's value head included: tests/adapters/test_fsdp_episode_mask.py.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_plugins.algorithms import GRPO, GRPOConfig, VALUE_PREDS
from asyncflow_plugins.algorithms.policy_loss import aggregate, kl_estimate
from tolerances import worst_case_tol

#: algorithm, options: every built-in with its KL, entropy, correction and value-loss paths on
CASES = [
    ("grpo", {}),
    ("grpo", {"correction": "decoupled", "kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01}),
    ("grpo", {"overlong_filter": True, "truncation_signal": "column", "kl_coef": 0.1, "kl_estimator": "k1"}),
    ("rloo", {"kl_coef": 0.1, "kl_estimator": "k2", "clip_high": 0.28}),
    ("reinforce_pp", {"baseline": "group_mean", "kl_in_reward_coef": 0.05, "gamma": 0.9, "kl_coef": 0.05}),
    ("reinforce_pp", {"normalize_advantages": False, "correction": "none"}),
    ("ppo", {"gamma": 0.95, "lam": 0.9, "kl_coef": 0.05, "entropy_coef": 0.01, "kl_in_reward_coef": 0.05}),
    ("ppo", {"whiten_advantages": False, "value_clip": None, "correction": "decoupled"}),
]
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM = 8
#: token-aligned ragged columns (what "removing a token" removes from)
TOKEN_COLUMNS = (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS, C.VALUES, VALUE_PREDS)


def make(name: str, agg: str, options: dict):
    opts = {"loss_agg": agg, **options}
    if agg == "seq-mean-token-sum-norm":
        opts["loss_agg_norm"] = NORM
    return get_plugin_manager().create("algorithm", name, opts)


def episode_batch(seed: int = 0, rows: int = 6) -> tuple[Batch, torch.Tensor]:
    """Rows of 3..7 tokens in groups of 3, a random loss mask (row 1 all masked, row 4 all kept), the current
    log-probs; masked tokens' inputs poisoned (NaN) and their current log-probs -inf."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3 + (2 * i) % 5 for i in range(rows)]
    resp = RaggedTensor.from_sequences([torch.randint(0, 10, (n,), generator=gen) for n in lengths])
    n = resp.numel_packed
    keep = torch.rand(n, generator=gen) < 0.6
    row = torch.repeat_interleave(torch.arange(rows), resp.lengths)
    keep[row == 1] = False
    keep[row == 4] = True

    def tokens(scale: float, shift: float = 0.0) -> torch.Tensor:
        return shift - scale * torch.rand(n, generator=gen)

    behavior = tokens(1.0)
    cols = {
        C.PROMPT_IDS: RaggedTensor.from_sequences([[1, 2]] * rows),
        C.RESPONSE_IDS: resp,
        C.REWARD: torch.rand(rows, generator=gen),
        C.GROUP_ID: torch.arange(rows) // 3,
        C.TRUNCATED: torch.tensor([False, False, True, False, False, False][:rows]),
        C.BEHAVIOR_LOGPROBS: behavior,
        C.OLD_LOGPROBS: behavior + 0.1 * tokens(1.0, 0.5),
        C.REF_LOGPROBS: behavior + 0.2 * tokens(1.0, 0.5),
        C.VALUES: tokens(1.0, 0.5),
        VALUE_PREDS: tokens(1.0, 0.5),
    }
    poison = torch.tensor(float("nan"))
    for name in (C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS, C.VALUES, VALUE_PREDS):
        cols[name] = RaggedTensor(torch.where(keep, cols[name], poison), resp.offsets)
    cols[C.LOSS_MASK] = RaggedTensor(keep, resp.offsets)
    logp = torch.where(keep, behavior + 0.3 * (torch.rand(n, generator=gen) - 0.5), torch.tensor(float("-inf")))
    return Batch(cols), logp


def without_masked(batch: Batch, logp: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """The batch with its masked tokens removed (rows stay, possibly empty) and no loss_mask column."""
    keep = batch[C.LOSS_MASK].values
    resp = batch[C.RESPONSE_IDS]
    row = torch.repeat_interleave(torch.arange(batch.num_rows), resp.lengths)
    lengths = torch.bincount(row[keep], minlength=batch.num_rows)
    cols = {name: col for name, col in batch.items() if name != C.LOSS_MASK}
    for name in TOKEN_COLUMNS:
        cols[name] = RaggedTensor.from_lengths(batch[name].values[keep], lengths)
    return Batch(cols), logp[keep]


def run_loss(algo, batch: Batch, logp: torch.Tensor, ctx: LossContext | None = None):
    """(loss, d loss / d logp, d loss / d value_preds) after compute_advantages."""
    train = algo.compute_advantages(batch)
    offsets = train[C.RESPONSE_IDS].offsets
    lp = logp.clone().requires_grad_(True)
    preds = train[VALUE_PREDS].values.clone().requires_grad_(True)
    train = train.with_columns(**{VALUE_PREDS: RaggedTensor(preds, offsets)})
    loss, metrics = algo.loss(RaggedTensor(lp, offsets), train, ctx or LossContext.of(train, 0))
    loss.backward()
    assert all(isinstance(v, float) for v in metrics.values())
    return loss.detach(), lp.grad, preds.grad, train


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_masked_tokens_get_exactly_zero_gradient(name, options, agg):
    algo = make(name, agg, options)
    batch, logp = episode_batch()
    keep = batch[C.LOSS_MASK].values
    loss, g_logp, g_preds, _ = run_loss(algo, batch, logp)
    assert torch.isfinite(loss), loss
    assert bool((g_logp[~keep] == 0.0).all()), g_logp[~keep]
    assert bool(torch.isfinite(g_logp).all())
    assert float(g_logp[keep].abs().sum()) > 0, "the unmasked tokens should carry a gradient"
    if g_preds is not None:  # ppo's value loss
        assert bool((g_preds[~keep] == 0.0).all()), g_preds[~keep]
        if algo.config.value_coef > 0:
            assert float(g_preds[keep].abs().sum()) > 0


def magnitude_bound(algo, batch: Batch, logp: torch.Tensor, train: Batch) -> float:
    """A bound on the aggregated size of the loss's per-token terms (sum of |term| / normaliser), for the
    rounding tolerance: |A| max(ratio, 1 + clip_high) x IS cap, |KL|, logp^2, and (|V'| + |G| + |V| + clip)^2."""
    cfg = algo.config
    old = batch[C.OLD_LOGPROBS].values if cfg.correction.value == "decoupled" else batch[C.BEHAVIOR_LOGPROBS].values
    per = train[C.ADVANTAGES].values.abs() * torch.clamp(torch.exp(logp - old), min=1 + cfg.clip_high)
    per = per * max(cfg.is_cap, 1.0)
    per = per + cfg.kl_coef * kl_estimate(logp, batch[C.REF_LOGPROBS].values, cfg.kl_estimator).abs()
    per = per + cfg.entropy_coef * logp**2
    if getattr(cfg, "value_coef", 0) > 0:
        v = train[VALUE_PREDS].values.detach().abs() + train[C.RETURNS].values.abs() + batch[C.VALUES].values.abs()
        per = per + cfg.value_coef * (v + (cfg.value_clip or 0.0)) ** 2
    ctx = LossContext.of(batch, 0)
    return float(aggregate(per.double(), batch[C.RESPONSE_IDS].offsets, cfg.loss_agg, ctx, cfg.agg_norm))


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_the_masked_loss_is_the_loss_without_the_masked_tokens(name, options, agg):
    """Advantages and loss of the masked batch equal those of the batch with the masked tokens removed.

    The per-token terms are the same numbers; only the order of the sums differs (zeros in between), so the
    two agree to the worst-case rounding of a sum of the batch's tokens plus rows (and a few operations per
    term), relative to the summed size of the terms.
    """
    algo = make(name, agg, options)
    batch, logp = episode_batch(seed=1)
    keep = batch[C.LOSS_MASK].values
    short, short_logp = without_masked(batch, logp)
    assert LossContext.of(batch, 0).global_tokens == LossContext.of(short, 0).global_tokens == int(keep.sum())
    masked_loss, g_masked, _, masked_train = run_loss(algo, batch, logp)
    short_loss, g_short, _, short_train = run_loss(algo, short, short_logp)
    assert torch.equal(masked_train[C.ADVANTAGES].values[keep], short_train[C.ADVANTAGES].values)
    terms = batch[C.RESPONSE_IDS].numel_packed + batch.num_rows + 16
    tol = worst_case_tol(terms, magnitude_bound(algo, short, short_logp, short_train))
    assert abs(float(masked_loss) - float(short_loss)) <= tol, (float(masked_loss), float(short_loss), tol)
    # each gradient element is one term's derivative divided by the same normaliser: a few roundings apart
    grad_tol = worst_case_tol(16, float(g_short.abs().max()))
    assert torch.allclose(g_masked[keep], g_short, rtol=0, atol=grad_tol)


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_an_all_ones_mask_changes_nothing_and_uint8_equals_bool(name, options):
    """No token masked: bit for bit the loss and gradients of the batch without the column; uint8 as bool."""
    algo = make(name, "seq-mean-token-mean", options)
    batch, logp = episode_batch(seed=2)
    resp = batch[C.RESPONSE_IDS]
    clean = {n: RaggedTensor(torch.nan_to_num(batch[n].values, nan=-0.5), resp.offsets)
             for n in TOKEN_COLUMNS[1:]}
    plain = batch.with_columns(**clean)
    plain = Batch({n: c for n, c in plain.items() if n != C.LOSS_MASK})
    logp = torch.nan_to_num(logp, neginf=-2.0)
    ones = plain.with_columns(**{C.LOSS_MASK: RaggedTensor(torch.ones(resp.numel_packed, dtype=torch.bool),
                                                           resp.offsets)})
    want = run_loss(algo, plain, logp)
    got = run_loss(algo, ones, logp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    as_bool = run_loss(algo, batch, torch.nan_to_num(logp))
    as_u8 = batch.with_columns(**{C.LOSS_MASK: RaggedTensor(batch[C.LOSS_MASK].values.to(torch.uint8), resp.offsets)})
    got_u8 = run_loss(algo, as_u8, torch.nan_to_num(logp))
    assert torch.equal(as_bool[0], got_u8[0]) and torch.equal(as_bool[1], got_u8[1])


@pytest.mark.parametrize("mask, message", [
    (lambda resp: RaggedTensor(torch.ones(resp.numel_packed), resp.offsets), "must be bool or uint8"),
    (lambda resp: RaggedTensor.from_sequences([[1] * 2] * len(resp), dtype=torch.bool), "not aligned"),
    (lambda resp: RaggedTensor(torch.full((resp.numel_packed,), 2, dtype=torch.uint8), resp.offsets),
     "values other than 0 and 1"),
    (lambda resp: torch.ones(len(resp), dtype=torch.bool), "must be a ragged column"),
])
def test_a_malformed_mask_is_refused_with_what_to_write(mask, message):
    batch, _ = episode_batch()
    bad = batch.with_columns(**{C.LOSS_MASK: mask(batch[C.RESPONSE_IDS])})
    with pytest.raises(ValueError, match=message):
        LossContext.of(bad, 0)


# ------------------------------------------------------------------------------------------ trainers


class CountingGRPO(GRPO):
    """GRPO reporting the step's ``ctx.global_tokens`` as a metric (it reaches rank processes pickled)."""

    def __init__(self) -> None:
        super().__init__(GRPOConfig())

    def loss(self, logprobs, batch, ctx):
        loss, metrics = super().loss(logprobs, batch, ctx)
        return loss, {**metrics, "global_tokens": float(ctx.global_tokens)}


def masked(batch: Batch, keep: torch.Tensor) -> Batch:
    return batch.with_columns(**{C.LOSS_MASK: RaggedTensor(keep, batch[C.RESPONSE_IDS].offsets)})


def lm_batch(vocab: int, rows: int = 6, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (2 + i % 3,), generator=gen)
                                                   for i in range(rows)]),
        C.RESPONSE_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (2 + (3 * i) % 5,), generator=gen)
                                                     for i in range(rows)]),
        C.REWARD: (torch.arange(rows) % 2 == 0).float(),
        C.GROUP_ID: torch.arange(rows) // 3,
    })


def alternate(batch: Batch) -> torch.Tensor:
    resp = batch[C.RESPONSE_IDS]
    within = torch.arange(resp.numel_packed) - torch.repeat_interleave(resp.offsets[:-1], resp.lengths)
    return within % 2 == 0


def test_toy_trainer_counts_unmasked_tokens_and_a_fully_masked_step_has_zero_gradient():
    engine = get_plugin_manager().create("train_engine", "toy", {"vocab_size": 16, "micro_batch_tokens": 8})
    algo = CountingGRPO()

    async def go():
        await engine.setup()
        batch = lm_batch(16)
        lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
        keep = alternate(train)
        # first step (Adam has no momentum yet): every token masked
        before = engine._param.detach().clone()
        metrics = await engine.train_step(masked(train, torch.zeros_like(keep)), algo)
        assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
        assert bool((engine._param.grad == 0.0).all())
        assert torch.equal(engine._param.detach(), before)  # Adam's first step with a zero gradient moves nothing
        metrics = await engine.train_step(masked(train, keep), algo)
        assert metrics["micro_batches"] > 1
        assert metrics["algo/global_tokens"] == int(keep.sum()) < train[C.RESPONSE_IDS].numel_packed
        assert metrics["grad_norm"] > 0
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_fsdp_trainer_counts_unmasked_tokens_and_a_fully_masked_step_has_zero_gradient():
    testing = pytest.importorskip("asyncflow_fsdp.testing", reason="asyncflow-fsdp is not installed")
    vocab = testing.TINY_QWEN2["vocab_size"]
    opts = testing.tiny_options(world_size=1, micro_batch_tokens=24, export_dtype="float32",
                                model={"hf_config": dict(testing.TINY_QWEN2), "dtype": "float32"})
    engine = get_plugin_manager().create("train_engine", "fsdp", opts)
    algo = CountingGRPO()

    async def weights():
        return {n: t.clone() async for b in engine.export_weights(bucket_bytes=1 << 20) for n, t in b.tensors()}

    async def go():
        await engine.setup()
        try:
            batch = lm_batch(vocab)
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
            keep = alternate(train)
            # first step (AdamW has no momentum yet, no decay): every token masked
            before = await weights()
            metrics = await engine.train_step(masked(train, torch.zeros_like(keep)), algo)
            assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0 and metrics["tokens"] == 0
            after = await weights()
            assert all(torch.equal(after[n], before[n]) for n in before)
            metrics = await engine.train_step(masked(train, keep), algo)
            assert metrics["micro_batches"] > 1
            assert metrics["tokens"] == int(keep.sum()) < train[C.RESPONSE_IDS].numel_packed
            assert metrics["algo/global_tokens"] == int(keep.sum())
            assert metrics["grad_norm"] > 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(go(), 240))


# ------------------------------------------------------------------------------------------ the spec check


class MaskBlindGRPO(GRPO):
    """An algorithm written before the column: it drops ``loss_mask`` and trains on every token."""

    def __init__(self) -> None:
        super().__init__(GRPOConfig())

    def loss(self, logprobs, batch, ctx):
        return super().loss(logprobs, Batch({n: c for n, c in batch.items() if n != C.LOSS_MASK}), ctx)


def test_the_spec_check_fails_a_mask_blind_algorithm_and_says_what_to_do():
    from asyncflow_spec import AlgorithmSpec

    check = AlgorithmSpec().test_masked_tokens_contribute_nothing
    check(lambda: GRPO(GRPOConfig()))  # the built-in passes
    with pytest.raises(AssertionError, match=r"ignores loss_mask \(\d+ of \d+ masked tokens got a non-zero gradient"
                                             r"; the loss changes .*LossContext.token_mask.*predates_loss_mask"):
        check(MaskBlindGRPO)

    class Predating(AlgorithmSpec):
        predates_loss_mask = True

    with pytest.raises(pytest.xfail.Exception, match="MaskBlindGRPO predates loss_mask"):
        Predating().test_masked_tokens_contribute_nothing(MaskBlindGRPO)
    with pytest.raises(pytest.fail.Exception, match="honours loss_mask now: remove `predates_loss_mask = True`"):
        Predating().test_masked_tokens_contribute_nothing(lambda: GRPO(GRPOConfig()))


@pytest.mark.gpu
@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_the_mask_holds_on_cuda_as_the_megatron_worker_calls_the_loss(name, options):
    """Advantages on the CPU (the advantage stage), the loss on CUDA tensors (the megatron worker moves the
    micro-batch to the logits' device): masked tokens get exactly zero gradient there too."""
    algo = make(name, "seq-mean-token-mean", options)
    batch, logp = episode_batch()
    train = algo.compute_advantages(batch)
    if C.RETURNS not in train:
        train = train.with_columns(**{C.RETURNS: train[C.ADVANTAGES]})
    dev = torch.device("cuda")
    on = Batch({n: c.to(dev) for n, c in train.items()})
    lp = logp.to(dev).requires_grad_(True)
    loss, _ = algo.loss(RaggedTensor(lp, on[C.RESPONSE_IDS].offsets), on, LossContext.of(on, 0))
    loss.backward()
    keep = on[C.LOSS_MASK].values
    assert torch.isfinite(loss) and bool((lp.grad[~keep] == 0.0).all()) and float(lp.grad[keep].abs().sum()) > 0


@pytest.mark.slow  # two megatron engines: about 27 s on 2 cores
def test_megatron_trainer_on_the_cpu_is_blind_to_the_masked_tokens_of_episodes():
    """Two megatron engines from one seed (world 1, gloo, float32): one trains on episodes as the rollout writes
    them, the other on the same rows with every masked token's behaviour and reference log-probs and advantages
    replaced by NaN or +-1e4. Their losses, gradient norms and weights after the step are bit for bit the same;
    a next step that shifts one *sampled* token's advantage in the second engine only moves them apart."""
    testing = pytest.importorskip("asyncflow_megatron.testing", reason="asyncflow-megatron is not installed")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from tests.flow.test_episode_grad import episode_batch as episodes

    opts = testing.cpu_options(model={"hf_config": dict(testing.TINY_QWEN2), "dtype": "float32"},
                               params_dtype="float32", export_dtype="float32", micro_batch_tokens=24, world_size=1)
    # clip_high wide: after the first step a token's ratio may sit past 1 + 0.2, where a larger positive advantage
    # would change nothing (the control below shifts one with a positive advantage)
    algo = make("grpo", "token-mean", {"kl_coef": 0.1, "kl_estimator": "k3", "clip_high": 10.0})
    batch = episodes(rows=6, seed=1)  # before the loop: the writer runs its own
    keep = batch[C.LOSS_MASK].values.bool()
    gen = torch.Generator().manual_seed(5)

    def garbage(col: RaggedTensor) -> RaggedTensor:
        noise = 1e4 * torch.randn(col.values.shape, generator=gen)
        noise[torch.rand(col.values.shape, generator=gen) < 0.5] = float("nan")
        return RaggedTensor(torch.where(keep, col.values, noise), col.offsets)

    async def weights(engine):
        return {n: t.clone() async for b in engine.export_weights(bucket_bytes=1 << 20) for n, t in b.tensors()}

    async def go():
        a, b = (get_plugin_manager().create("train_engine", "megatron", opts) for _ in range(2))
        await asyncio.gather(a.setup(), b.setup())
        try:
            lp = (await a.compute_logprobs(batch))[C.LOGPROBS]
            train = algo.compute_advantages(batch.with_columns(**{
                C.BEHAVIOR_LOGPROBS: RaggedTensor(torch.where(keep, lp.values - 0.05, 0.0), lp.offsets),
                C.REF_LOGPROBS: RaggedTensor(lp.values - 0.1, lp.offsets)}))
            poisoned = train.with_columns(**{c: garbage(train[c]) for c in
                                             (C.BEHAVIOR_LOGPROBS, C.REF_LOGPROBS, C.ADVANTAGES)})
            ma, mb = await asyncio.gather(a.train_step(train, algo), b.train_step(poisoned, algo))
            assert math.isfinite(ma["grad_norm"]) and ma["grad_norm"] > 0 and ma["tokens"] == int(keep.sum())
            assert (mb["loss"], mb["grad_norm"]) == (ma["loss"], ma["grad_norm"])
            wa, wb = await weights(a), await weights(b)
            assert all(torch.equal(wa[n], wb[n]) for n in wa), "masked tokens' inputs changed the step"
            adv = train[C.ADVANTAGES]
            one = torch.zeros_like(keep)
            one[int((keep & (adv.values > 0)).nonzero()[0])] = True
            shifted = train.with_columns(**{C.ADVANTAGES: RaggedTensor(torch.where(one, adv.values + 0.5, adv.values),
                                                                       adv.offsets)})
            ma, mb = await asyncio.gather(a.train_step(train, algo), b.train_step(shifted, algo))
            assert ma["grad_norm"] != mb["grad_norm"]
            wa, wb = await weights(a), await weights(b)
            assert not all(torch.equal(wa[n], wb[n]) for n in wa)
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())

    asyncio.run(asyncio.wait_for(go(), 240))
