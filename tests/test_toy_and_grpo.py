"""The built-in toy engines, transport and GRPO beyond the generic contract: hand-computed values, learning."""

import asyncio

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, GenerationRequest, RaggedTensor, SamplingParams
from asyncflow_plugins.toy.policy import sampling_logprobs
from tolerances import logprob_tol


def test_grpo_advantages_by_hand():
    algo = get_plugin_manager().create("algorithm", "grpo", {"eps": 1e-12})
    batch = Batch(
        {
            C.RESPONSE_IDS: RaggedTensor.from_sequences([[1, 2], [3], [4, 5, 6], [7]]),
            C.REWARD: torch.tensor([1.0, 0.0, 2.0, 4.0]),
            C.GROUP_ID: torch.tensor([0, 0, 1, 1]),
        }
    )
    adv = algo.compute_advantages(batch)[C.ADVANTAGES]
    # group 0: mean .5, unbiased std .7071 -> +-.7071 ; group 1: mean 3, std 1.4142 -> -/+ .7071
    s = 0.5**0.5
    assert torch.allclose(adv.values, torch.tensor([s, s, -s, -s, -s, -s, s]), atol=1e-5)
    no_std = get_plugin_manager().create("algorithm", "grpo", {"normalize_std": False})
    assert no_std.compute_advantages(batch)[C.ADVANTAGES].values.tolist() == [0.5, 0.5, -0.5, -1.0, -1.0, -1.0, 1.0]


def test_grpo_incomplete_group_is_an_error_when_group_size_is_set():
    algo = get_plugin_manager().create("algorithm", "grpo", {"group_size": 2})
    batch = Batch({C.RESPONSE_IDS: RaggedTensor.from_sequences([[1], [2], [3]]), C.REWARD: torch.zeros(3), C.GROUP_ID: torch.tensor([0, 0, 1])})
    with pytest.raises(ValueError, match="group 1 has 1 samples, expected group_size=2"):
        algo.compute_advantages(batch)


def test_grpo_clipped_loss_by_hand():
    algo = get_plugin_manager().create("algorithm", "grpo", {"correction": "none", "clip_low": 0.2, "clip_high": 0.2})
    offsets = torch.tensor([0, 2, 3])
    batch = Batch(
        {
            C.RESPONSE_IDS: RaggedTensor(torch.tensor([1, 2, 3]), offsets),
            C.ADVANTAGES: RaggedTensor(torch.tensor([1.0, 1.0, -1.0]), offsets),
            C.BEHAVIOR_LOGPROBS: RaggedTensor(torch.log(torch.tensor([0.5, 0.5, 0.5])), offsets),
        }
    )
    # ratios 0.6/0.5=1.2 (A=+1 -> min(1.2, 1.2)=1.2), 0.8/0.5=1.6 (A=+1 -> clipped 1.2), 0.2/0.5=0.4 (A=-1 -> max(-.4,-.8) -> -(-0.8))
    logp = RaggedTensor(torch.log(torch.tensor([0.6, 0.8, 0.2])), offsets)
    loss, metrics = algo.loss(logp, batch, LossContext(global_tokens=3, global_sequences=2, policy_version=0))
    expected = -(1.2 + 1.2 + -0.8) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)


def test_top_p_and_top_k_keep_the_documented_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = sampling_logprobs(logits, 1.0, top_p=0.7).exp()
    assert torch.allclose(p, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]), atol=1e-6)
    k = sampling_logprobs(logits, 1.0, top_k=1).exp()
    assert torch.allclose(k, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_rollout_logprobs_match_trainer_logprobs():
    """Same seed, same weights: the trainer reproduces the sampler's log-probs (the shared convention)."""

    async def body():
        pm = get_plugin_manager()
        engine = pm.create("rollout_engine", "toy", {"vocab_size": 12, "seed": 4})
        trainer = pm.create("train_engine", "toy", {"vocab_size": 12, "seed": 4, "temperature": 0.7})
        await engine.start()
        await trainer.setup()
        reqs = [GenerationRequest(f"r{i}", (i % 12,), SamplingParams(max_new_tokens=6, temperature=0.7)) for i in range(8)]
        results = [r async for r in engine.generate(reqs)]
        batch = Batch(
            {
                C.PROMPT_IDS: RaggedTensor.from_sequences([list(r.prompt_token_ids) for r in results]),
                C.RESPONSE_IDS: RaggedTensor.from_sequences([list(r.token_ids) for r in results]),
            }
        )
        got = (await trainer.compute_logprobs(batch))[C.LOGPROBS].values
        want = torch.tensor([lp for r in results for lp in r.logprobs])
        # one log-softmax over the vocabulary each, per row on one side and batched on the other
        assert torch.allclose(got, want, rtol=0, atol=logprob_tol(want, terms=12))

    asyncio.run(body())


def test_weight_update_through_the_transport_changes_the_policy_version():
    async def body():
        pm = get_plugin_manager()
        engine = pm.create("rollout_engine", "toy", {"vocab_size": 8})
        trainer = pm.create("train_engine", "toy", {"vocab_size": 8, "lr": 0.5})
        transport = pm.create("weight_transport", "inprocess")
        algo = pm.create("algorithm", "grpo")
        await engine.start()
        await trainer.setup()
        prompt = RaggedTensor.from_sequences([[1]] * 4)
        resp = RaggedTensor.from_sequences([[2, 3]] * 4)
        batch = Batch({C.PROMPT_IDS: prompt, C.RESPONSE_IDS: resp, C.REWARD: torch.tensor([1.0, 0.0, 1.0, 0.0]),
                       C.GROUP_ID: torch.tensor([0, 0, 0, 0])})
        lp = (await trainer.compute_logprobs(batch))[C.LOGPROBS]
        batch = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
        await trainer.train_step(batch, algo)
        await transport.send(trainer.export_weights(bucket_bytes=64), deadline_s=10)
        await engine.update_weights(1, transport.receive(min_version=1, deadline_s=10))
        assert engine.version == 1
        (res,) = [r async for r in engine.generate([GenerationRequest("x", (1,), SamplingParams(max_new_tokens=3))])]
        assert set(res.versions) == {1}
        await transport.close()

    asyncio.run(body())


def test_toy_policy_learns_to_prefer_rewarded_token():
    """Fifty GRPO steps on 'reward = 1 if the first token is 5' move the probability of 5 up a lot."""

    async def body():
        pm = get_plugin_manager()
        engine = pm.create("rollout_engine", "toy", {"vocab_size": 8, "seed": 1})
        trainer = pm.create("train_engine", "toy", {"vocab_size": 8, "seed": 1, "lr": 0.1})
        algo = pm.create("algorithm", "grpo", {"group_size": 8})
        await engine.start()
        await trainer.setup()

        def p5() -> float:
            return float(torch.softmax(trainer._param.detach()[0], -1)[5])

        before = p5()
        for step in range(50):
            reqs = [GenerationRequest(f"s{step}-{i}", (0,), SamplingParams(max_new_tokens=1)) for i in range(8)]
            res = [r async for r in engine.generate(reqs)]
            batch = Batch({
                C.PROMPT_IDS: RaggedTensor.from_sequences([[0]] * 8),
                C.RESPONSE_IDS: RaggedTensor.from_sequences([list(r.token_ids) for r in res]),
                C.BEHAVIOR_LOGPROBS: RaggedTensor.from_sequences([list(r.logprobs) for r in res], dtype=torch.float32),
                C.REWARD: torch.tensor([float(r.token_ids[0] == 5) for r in res]),
                C.GROUP_ID: torch.zeros(8, dtype=torch.int64),
            })
            await trainer.train_step(algo.compute_advantages(batch), algo)
            await engine.update_weights(trainer.version, trainer.export_weights(bucket_bytes=1 << 16))
        assert p5() > max(0.6, 3 * before), (before, p5())

    asyncio.run(body())
