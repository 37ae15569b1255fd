"""The fsdp trainer honours an episode's loss mask: the gradient it takes is exactly blind to masked tokens.

A world-1 rank on the CPU (``asyncflow_fsdp.testing.local_rank``, float32) runs
its real train step (``op_train``: micro-batches, forward, the algorithm's loss,
backward, clipping) on episodes as the rollout writes them (observations
between sampled turns, ``loss_mask`` 0 on them). The optimizer's ``step`` is
replaced by a probe that copies every parameter's gradient and stops the step,
so one rank's weights serve every comparison.

For GRPO, RLOO, REINFORCE++ and PPO (with the engine's value head, whose
predictions the loss reads as ``value_preds``): the gradient of the batch
whose *masked* tokens' behaviour, old and reference log-probs, advantages,
returns and values are replaced by garbage (NaN, huge values) is bit for bit
the gradient of the clean batch; the same perturbation of one *sampled* token
changes it (so the comparison can fail).

Through the whole engine (the driver's micro-batching, slow-marked): two
engines from one seed step on the clean and the poisoned episodes and hold
the same weights afterwards, bit for bit. (PPO needs a value head, which the
toy trainer has not: the run refuses that pairing; PPO on episodes is here.)
"""

from __future__ import annotations

import math

import pytest
import torch

testing = pytest.importorskip("asyncflow_fsdp.testing", reason="asyncflow-fsdp is not installed")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.interfaces import LossContext  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import Batch, RaggedTensor  # noqa: E402
from tests.flow.test_episode_grad import episode_batch  # noqa: E402

#: what a masked token's inputs may hold: the perturbation of every per-token input column
PERTURBED = (C.BEHAVIOR_LOGPROBS, C.OLD_LOGPROBS, C.REF_LOGPROBS, C.ADVANTAGES, C.RETURNS, C.VALUES)

CASES = [
    ("grpo", {}),
    ("grpo", {"kl_coef": 0.1, "kl_estimator": "k3", "loss_agg": "seq-mean-token-mean", "entropy_coef": 0.01}),
    ("rloo", {"clip_high": 0.28, "correction": "decoupled"}),
    ("reinforce_pp", {"baseline": "group_mean", "kl_coef": 0.05}),
    ("ppo", {"gamma": 0.95, "lam": 0.9}),
    ("ppo", {"whiten_advantages": False, "value_clip": None, "loss_agg": "seq-mean-token-mean"}),
]


class _Probe(Exception):
    """Raised by the probe in place of the optimizer step: the gradients were taken."""


def _options() -> dict:
    return testing.tiny_options(world_size=1, value_head=True,
                                model={"hf_config": dict(testing.TINY_QWEN2), "dtype": "float32"})


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def rank(request):
    """One world-1 rank with a value head; its optimizer never steps (the probe stops every step)."""
    with testing.local_rank(_options(), device=request.param) as worker:
        yield worker


def _rows(batch: Batch) -> list[torch.Tensor]:
    """Three micro-batches of consecutive rows (the gradient accumulates over them)."""
    n = batch.num_rows
    cut = [0, n // 3, 2 * n // 3, n]
    return [torch.arange(a, b) for a, b in zip(cut, cut[1:]) if b > a]


def _score(worker, batch: Batch, values: bool) -> tuple[RaggedTensor, RaggedTensor | None]:
    parts = _rows(batch)
    lps, vals = worker.op_logprobs({"batch": batch, "micro_batches": parts, "passes": len(parts), "values": values})
    offsets = batch[C.RESPONSE_IDS].offsets
    lp = RaggedTensor(torch.cat(lps).float(), offsets)
    return lp, (RaggedTensor(torch.cat(vals).float(), offsets) if vals is not None else None)


def _gradient(worker, batch: Batch, algo) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient after the rank's train step over ``batch`` (not applied)."""
    import pickle

    taken: dict[str, torch.Tensor] = {}

    def probe(*args, **kwargs):
        for name, p in worker.holder.named_parameters():
            if p.grad is not None:
                taken[name] = p.grad.detach().clone()
        raise _Probe

    parts = _rows(batch)
    payload = {"batch": batch, "micro_batches": parts, "passes": len(parts), "ctx": LossContext.of(batch, 0),
               "algorithm": pickle.dumps(algo)}
    worker.optimizer.step = probe
    try:
        out = worker.op_train(payload)
    except _Probe:
        out = None
    finally:
        del worker.optimizer.step
    assert out is None, f"the rank skipped its step: gradient norm {out['grad_norm']} (a NaN or inf reached it)"
    assert taken, "the train step took no gradient"
    return taken


def _perturb(train: Batch, where: torch.Tensor, seed: int) -> Batch:
    """``train`` with every per-token input at positions ``where`` replaced: NaN on half of them, +-1e4 noise on
    the others (so neither a NaN guard nor a clamp alone hides a leak)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in PERTURBED:
        if name not in train.columns:
            continue
        col = train[name]
        noise = 1e4 * torch.randn(col.values.shape, generator=gen)
        noise[torch.rand(col.values.shape, generator=gen) < 0.5] = float("nan")
        out[name] = RaggedTensor(torch.where(where, noise.to(col.values.dtype), col.values), col.offsets)
    return train.with_columns(**out)


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_the_fsdp_gradient_ignores_everything_at_masked_tokens_of_episodes(rank, name, options):
    algo = get_plugin_manager().create("algorithm", name, options)
    batch = episode_batch(rows=6, seed=1)
    mask = batch[C.LOSS_MASK].values.bool()
    assert 0 < int(mask.sum()) < mask.numel()
    assert bool((batch[C.RESPONSE_IDS].values < testing.TINY_QWEN2["vocab_size"]).all())
    # the rollout's and the `old` stage's columns, as a run fills them (behaviour log-probs: the trainer's own
    # on sampled tokens, 0 on observed ones as the writer puts them; values from the head at step start)
    wants_values = C.VALUES in algo.required_columns
    lp, values = _score(rank, batch, wants_values)
    cols = {C.BEHAVIOR_LOGPROBS: RaggedTensor(torch.where(mask, lp.values - 0.05, 0.0), lp.offsets),
            C.OLD_LOGPROBS: RaggedTensor(lp.values - 0.02, lp.offsets),
            C.REF_LOGPROBS: RaggedTensor(lp.values - 0.1, lp.offsets)}
    if wants_values:
        assert values is not None
        cols[C.VALUES] = values
    train = algo.compute_advantages(batch.with_columns(**cols))
    assert int((train[C.ADVANTAGES].values[mask] != 0).sum()) > 0

    clean = _gradient(rank, train, algo)
    # the kernels' own run-to-run difference: none on the CPU (every comparison below is then bit for bit); on
    # CUDA, atomics (the embedding's backward) may sum in another order, so "unchanged" means within 4x of it
    again = _gradient(rank, train, algo)
    noise = {p: 4 * (again[p] - g).abs().max() for p, g in clean.items()}
    if rank.device.type == "cpu":
        assert all(float(v) == 0.0 for v in noise.values()), "the CPU step is not reproducible"
    assert all(bool(torch.isfinite(g).all()) for g in clean.values())
    assert any(bool((g != 0).any()) for g in clean.values())
    if wants_values:  # PPO trains the head through value_preds
        assert any(n.startswith("value_head.") and bool((g != 0).any()) for n, g in clean.items()), list(clean)

    garbage = _gradient(rank, _perturb(train, ~mask, seed=3), algo)
    assert set(garbage) == set(clean)
    for pname, g in clean.items():
        assert bool(((garbage[pname] - g).abs() <= noise[pname]).all()), \
            f"{pname}: the masked tokens' inputs changed the gradient"

    # control: the same perturbation of one sampled token (not NaN: a finite change) moves the gradient
    one = torch.zeros_like(mask)
    one[int(mask.nonzero()[len(mask.nonzero()) // 2])] = True
    shifted = {c: RaggedTensor(torch.where(one, train[c].values + 0.5, train[c].values), train[c].offsets)
               for c in (C.BEHAVIOR_LOGPROBS, C.ADVANTAGES) if c in train.columns}
    moved = _gradient(rank, train.with_columns(**shifted), algo)
    diff = max(float((moved[p] - clean[p]).abs().max() - noise[p]) for p in clean)
    assert diff > 0 and math.isfinite(diff), "perturbing a sampled token did not change the gradient"


@pytest.mark.slow  # two engines: about 13 s on 2 cores
def test_through_the_engine_masked_inputs_change_neither_the_step_nor_the_weights():
    """The whole engine (the driver's micro-batching and its rank): two engines from one seed take a step on the
    clean and on the poisoned episodes (GRPO): the same loss, gradient norm and weights, bit for bit; a second
    step that shifts one sampled token's advantage in the second engine only moves them apart."""
    import asyncio

    algo = get_plugin_manager().create("algorithm", "grpo", {"kl_coef": 0.1, "kl_estimator": "k3",
                                                             "clip_high": 10.0})
    batch = episode_batch(rows=6, seed=2)  # before the loop: the writer runs its own
    mask = batch[C.LOSS_MASK].values.bool()
    opts = testing.tiny_options(world_size=1, micro_batch_tokens=24, export_dtype="float32",
                                model={"hf_config": dict(testing.TINY_QWEN2), "dtype": "float32"})

    async def weights(engine):
        return {n: t.clone() async for b in engine.export_weights(bucket_bytes=1 << 20) for n, t in b.tensors()}

    async def go():
        a, b = (get_plugin_manager().create("train_engine", "fsdp", opts) for _ in range(2))
        await asyncio.gather(a.setup(), b.setup())
        try:
            lp = (await a.compute_logprobs(batch))[C.LOGPROBS]
            train = algo.compute_advantages(batch.with_columns(**{
                C.BEHAVIOR_LOGPROBS: RaggedTensor(torch.where(mask, lp.values - 0.05, 0.0), lp.offsets),
                C.REF_LOGPROBS: RaggedTensor(lp.values - 0.1, lp.offsets)}))
            ma, mb = await asyncio.gather(a.train_step(train, algo), b.train_step(_perturb(train, ~mask, 4), algo))
            assert ma["micro_batches"] > 1 and ma["grad_norm"] > 0 and math.isfinite(ma["grad_norm"])
            assert (mb["loss"], mb["grad_norm"], mb["tokens"]) == (ma["loss"], ma["grad_norm"], ma["tokens"])
            wa, wb = await weights(a), await weights(b)
            assert all(torch.equal(wa[n], wb[n]) for n in wa), "masked tokens' inputs changed the step"
            adv = train[C.ADVANTAGES]
            one = torch.zeros_like(mask)
            one[int((mask & (adv.values > 0)).nonzero()[0])] = True  # clip_high 10: its ratio is never clipped
            shifted = train.with_columns(**{C.ADVANTAGES: RaggedTensor(torch.where(one, adv.values + 0.5, adv.values),
                                                                       adv.offsets)})
            ma, mb = await asyncio.gather(a.train_step(train, algo), b.train_step(shifted, algo))
            assert ma["grad_norm"] != mb["grad_norm"]
            wa, wb = await weights(a), await weights(b)
            assert not all(torch.equal(wa[n], wb[n]) for n in wa)
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())

    asyncio.run(asyncio.wait_for(go(), 240))
