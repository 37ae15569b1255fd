"""The gradient on masked (observed) tokens of an episode is exactly zero with the torch (toy) trainer.

"Exactly zero" means the loss does not depend on what the model predicts at
masked positions: the trainer's log-probs at every masked token are replaced
by arbitrary values that still depend on the weights (large, random, with a
gradient path), their behaviour log-probs by NaN, and the step's loss, the
gradient and the weights after the optimizer step are bitwise the same as
without the perturbation. The control perturbs one *sampled* token the same
way and must change the gradient (so the comparison can fail).

The batch is episodes as the rollout writes them (flow/trajectory_writer.py):
sampled turns and observations in ``response_ids`` with their ``loss_mask``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import asyncflow_plugins.toy.train as toy_train
from asyncflow_core import columns as C
from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT, TrajectoryWriter
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_core.types.episode import Segment, Trajectory

VOCAB = 16


class _Store:
    def __init__(self) -> None:
        self.cols: dict = {}

    async def put(self, cols, *, rows, versions):
        self.cols = cols

    async def ack(self, meta):
        pass


def episode_batch(rows: int = 6, seed: int = 0) -> Batch:
    """Episodes of 2-4 turns with observations between them, written by the TrajectoryWriter, as a batch."""
    gen = torch.Generator().manual_seed(seed)

    def toks(n):
        return tuple(torch.randint(0, VOCAB, (n,), generator=gen).tolist())

    trajs = []
    for i in range(rows):
        segs = []
        turns = 2 + i % 3
        for t in range(turns):
            n = 1 + (i + 2 * t) % 4
            segs.append(Segment(toks(n), sampled=True, logprobs=(-1.0,) * n, versions=(0,) * n, turn=t))
            if t < turns - 1:
                segs.append(Segment(toks(2 + t % 3), sampled=False, turn=t))
        trajs.append(Trajectory(prompt_ids=toks(3), segments=segs, turn_rewards=[0.0] * turns, reward=float(i % 2)))
    store = _Store()
    w = TrajectoryWriter("rollout", interval_s=1.0, spawn=lambda c: None, on_written=lambda: None,
                         columns=ROLLOUT_OUT + C.EPISODE_COLUMNS + (C.REWARD,))
    w.ctx = SimpleNamespace(store=store, version=0, processed=Counter(), counters=Counter())

    async def write():
        for i, tr in enumerate(trajs):
            await w.write(SimpleNamespace(row=i, lease=SimpleNamespace(meta=None, remaining=rows)), tr)
        await w.flush()

    asyncio.run(write())
    cols = dict(store.cols)
    cols[C.PROMPT_IDS] = RaggedTensor.from_sequences([torch.tensor(t.prompt_ids) for t in trajs])
    cols[C.GROUP_ID] = torch.arange(rows) // 3
    return Batch(cols)


def _engine():
    return get_plugin_manager().create("train_engine", "toy", {"vocab_size": VOCAB, "micro_batch_tokens": 12})


async def _step(batch: Batch, algo, perturb: torch.Tensor | None) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """One train step of a fresh toy engine; ``perturb``: bool per response token whose trainer log-prob is
    replaced by an arbitrary weight-dependent value."""
    engine = _engine()
    await engine.setup()
    orig = toy_train.response_logprobs
    offsets = batch[C.RESPONSE_IDS].offsets
    noise = 1e3 * torch.randn(batch[C.RESPONSE_IDS].numel_packed, generator=torch.Generator().manual_seed(7))
    seen = {"start": 0}

    def patched(table, prompt_ids, response_ids, temperature):
        lp = orig(table, prompt_ids, response_ids, temperature)
        if perturb is None:
            return lp
        # micro-batches are consecutive rows: find where this one starts in the whole batch
        start = seen["start"]
        n = lp.values.numel()
        sel = perturb[start:start + n]
        seen["start"] = start + n
        bad = noise[start:start + n] + table.sum() * 1e2 + table[0, 0] ** 2
        return RaggedTensor(torch.where(sel, bad, lp.values), lp.offsets)

    toy_train.response_logprobs = patched
    try:
        metrics = await engine.train_step(batch, algo)
    finally:
        toy_train.response_logprobs = orig
    assert seen["start"] in (0, int(offsets[-1]))
    grad = engine._param.grad.detach().clone()
    return grad, metrics, engine._param.detach().clone()


@pytest.mark.parametrize("name,options", [
    ("grpo", {}),
    ("grpo", {"kl_coef": 0.1, "kl_estimator": "k3", "loss_agg": "seq-mean-token-mean"}),
    ("rloo", {"clip_high": 0.28}),
    ("reinforce_pp", {"baseline": "group_mean"}),
])
def test_masked_tokens_of_episodes_get_exactly_zero_gradient_in_the_toy_trainer(name, options):
    algo = get_plugin_manager().create("algorithm", name, options)
    batch = episode_batch()
    mask = batch[C.LOSS_MASK].values.bool()
    assert 0 < int(mask.sum()) < mask.numel()

    async def go():
        engine = _engine()
        await engine.setup()
        lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        cols = {C.BEHAVIOR_LOGPROBS: RaggedTensor(torch.where(mask, lp.values, torch.zeros_like(lp.values)),
                                                  lp.offsets)}
        if C.REF_LOGPROBS in algo.required_columns:
            cols[C.REF_LOGPROBS] = RaggedTensor(lp.values - 0.1, lp.offsets)
        if C.OLD_LOGPROBS in algo.required_columns:
            cols[C.OLD_LOGPROBS] = RaggedTensor(lp.values, lp.offsets)
        train = algo.compute_advantages(batch.with_columns(**cols))
        # the masked tokens' inputs poisoned, as a tool token's may be
        poisoned = {c: RaggedTensor(torch.where(mask, train[c].values, torch.full_like(train[c].values, float("nan"))),
                                    train[c].offsets)
                    for c in (C.BEHAVIOR_LOGPROBS, C.REF_LOGPROBS, C.OLD_LOGPROBS) if c in train.columns}
        clean_grad, clean_m, clean_w = await _step(train, algo, None)
        grad, m, w = await _step(train.with_columns(**poisoned), algo, ~mask)
        assert torch.isfinite(clean_grad).all() and bool((clean_grad != 0).any())
        assert torch.equal(grad, clean_grad)  # bitwise
        assert m["loss"] == clean_m["loss"] and torch.equal(w, clean_w)
        # control: the same perturbation of one sampled token changes the gradient
        one = torch.zeros_like(mask)
        one[int(mask.nonzero()[3])] = True
        grad_c, _, _ = await _step(train, algo, one)
        assert not torch.equal(grad_c, clean_grad)

    asyncio.run(asyncio.wait_for(go(), 60))
