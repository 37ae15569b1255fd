"""The ``fsdp`` engine at one rank without FSDP (``shard: auto``), against the same rank wrapped in FSDP2.

At world size 1 ``shard: auto`` skips ``fully_shard`` (on the CPU, and on a
GPU in float32): the rank trains the plain model. These tests pin down that
nothing else changes: the same log-probs, the same step, the same weights
out, the same checkpoints, which load into a sharded engine at world 1 and 2
and back. Tolerances are the rounding bounds of ``test_fsdp_engine``.

CI runs these through tests/adapters/test_fsdp.py.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from asyncflow_core import columns as C
from asyncflow_fsdp.config import FSDPTrainConfig
from asyncflow_fsdp.packing import micro_batches
from asyncflow_fsdp.testing import TINY_QWEN2, GRPOWithValueLoss, local_rank
from asyncflow_plugins.hf.model import build_causal_lm


def _engine_tests():
    """The helpers and tolerances of test_fsdp_engine.py, loaded by path (CI loads this module by path too)."""
    path = Path(__file__).with_name("test_fsdp_engine.py")
    spec = importlib.util.spec_from_file_location("asyncflow_fsdp_engine_test_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_E = _engine_tests()
STEP, assert_same_weights, exported, logprob_tol = _E.STEP, _E.assert_same_weights, _E.exported, _E.logprob_tol
grpo, make, model_config, pinned_options, run = _E.grpo, _E.make, _E.model_config, _E.pinned_options, _E.run
sample_batch, with_advantages = _E.sample_batch, _E.with_advantages


async def _one_step(engine, batch, algo, *, values: bool = False):
    """Setup, log-probs, one train step, weights out; always shut down."""
    await engine.setup()
    try:
        scored = await engine.compute_logprobs(batch, values=values)
        train = with_advantages(batch, scored[C.LOGPROBS], algo)
        metrics = await engine.train_step(train, algo)
        after = await engine.compute_logprobs(batch, values=values)
        return engine.info, scored, train, metrics, after, await exported(engine)
    finally:
        await engine.shutdown()


def test_auto_trains_the_plain_model_as_the_sharded_rank_does():
    """Same log-probs before and after one step, same loss, gradient norm and weights as ``shard: always``."""
    algo, batch = grpo(), sample_batch()
    plain = run(_one_step(make(world_size=1, micro_batch_tokens=20, **STEP), batch, algo))
    fsdp = run(_one_step(make(world_size=1, micro_batch_tokens=20, shard="always", **STEP), batch, algo))
    assert plain[0]["sharded"] is False and plain[0]["sharded_blocks"] == 0
    assert fsdp[0]["sharded"] is True and fsdp[0]["sharded_blocks"] == TINY_QWEN2["num_hidden_layers"]
    assert plain[0]["parameters"] == fsdp[0]["parameters"]
    before, want = plain[1][C.LOGPROBS].values, fsdp[1][C.LOGPROBS].values
    assert torch.allclose(before, want, rtol=0, atol=logprob_tol(want))
    assert plain[3]["micro_batches"] == fsdp[3]["micro_batches"] > 1  # several passes: gradients accumulate
    assert plain[3]["tokens"] == fsdp[3]["tokens"]
    # the norm errs by at most the gradient's error vector: sqrt(elements) times one element's rounding bound
    norm = fsdp[3]["grad_norm"]
    norm_tol = math.sqrt(plain[0]["parameters"]) * _E.grad_tol(plain[2], clip=max(norm, 1.0))
    assert abs(plain[3]["grad_norm"] - norm) <= norm_tol, (plain[3]["grad_norm"], norm, norm_tol)
    assert_same_weights(plain[5], fsdp[5], plain[2], "unsharded vs sharded at world 1")
    after, want_after = plain[4][C.LOGPROBS].values, fsdp[4][C.LOGPROBS].values
    assert not torch.equal(after, before)  # the step moved the policy
    assert torch.allclose(after, want_after, rtol=0, atol=logprob_tol(want_after))


def test_unsharded_rank_holds_the_seed_weights_as_plain_tied_parameters():
    """No DTensor, no FSDP module; the seed's weights bit for bit; tied embeddings stay one parameter."""
    hf = {**TINY_QWEN2, "tie_word_embeddings": True}
    options = pinned_options(model={"hf_config": hf, "dtype": "float32"})
    with local_rank(options) as worker:
        assert worker._fsdp == []
        net = worker.model
        assert all(type(p) is torch.nn.Parameter for p in net.parameters())
        assert net.get_output_embeddings().weight is net.get_input_embeddings().weight
        want = build_causal_lm(model_config().model_copy(update={"hf_config": hf}), seed=0).state_dict()
        got = net.state_dict()
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name


def test_checkpoint_of_the_plain_rank_resumes_sharded_at_world_1_and_2_and_back(tmp_path):
    """save unsharded at world 1 -> load at world 2 and at world 1 (``shard: always``): the restored weights and
    optimizer state give the uninterrupted engine's second step; a world-2 checkpoint loads into the plain rank."""
    algo, batch = grpo(), sample_batch()

    async def straight():
        engine = make(world_size=1, micro_batch_tokens=20, **STEP)
        await engine.setup()
        try:
            assert engine.info["sharded"] is False
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            await engine.train_step(train, algo)
            await engine.save(tmp_path / "plain")
            at_save = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(train, algo)
            return train, at_save, await exported(engine)
        finally:
            await engine.shutdown()

    async def resumed(path, train, **options):
        engine = make(micro_batch_tokens=20, **STEP, **options)
        await engine.setup()
        try:
            await engine.load(path)
            assert engine.version == 1
            restored = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            if options.get("world_size") == 2:
                await engine.save(tmp_path / "sharded")  # the same state, written by two ranks
            await engine.train_step(train, algo)
            return restored, await exported(engine)
        finally:
            await engine.shutdown()

    train, at_save, weights_two = run(straight())
    for options in ({"world_size": 2}, {"world_size": 1, "shard": "always"}):
        restored, weights = run(resumed(tmp_path / "plain", train, **options))
        assert torch.allclose(restored.values, at_save.values, rtol=0, atol=logprob_tol(at_save.values)), options
        assert_same_weights(weights, weights_two, train, f"plain checkpoint resumed with {options}", slope=1.5)
    restored, weights = run(resumed(tmp_path / "sharded", train, world_size=1))
    assert torch.allclose(restored.values, at_save.values, rtol=0, atol=logprob_tol(at_save.values))
    assert_same_weights(weights, weights_two, train, "world-2 checkpoint resumed unsharded", slope=1.5)


def test_value_head_of_the_plain_rank_trains_as_the_sharded_one():
    algo, batch = GRPOWithValueLoss(), sample_batch()
    plain = run(_one_step(make(world_size=1, value_head=True, **STEP), batch, algo, values=True))
    fsdp = run(_one_step(make(world_size=1, value_head=True, shard="always", **STEP), batch, algo, values=True))
    assert plain[0]["sharded"] is False
    assert torch.count_nonzero(plain[1][C.VALUES].values) == 0  # the head starts at zero
    moved, want = plain[4][C.VALUES].values, fsdp[4][C.VALUES].values
    assert torch.count_nonzero(moved) > 0  # value_loss trained the head
    assert torch.allclose(moved, want, rtol=0, atol=logprob_tol(want))


def test_shard_never_needs_one_rank():
    with pytest.raises(ValidationError, match="shard: never needs world_size 1"):
        FSDPTrainConfig.model_validate(pinned_options(world_size=2, shard="never"))
    assert FSDPTrainConfig.model_validate(pinned_options(shard="never")).sharded("cpu") is False
    auto = FSDPTrainConfig.model_validate(pinned_options())
    assert not auto.sharded("cpu") and not auto.sharded("cuda")  # float32: no policy for FSDP to supply
    bf16 = FSDPTrainConfig.model_validate(pinned_options(mixed_precision="bfloat16"))
    assert bf16.sharded("cuda") and not bf16.sharded("cpu")
    assert FSDPTrainConfig.model_validate(pinned_options(world_size=2)).sharded("cpu")


@pytest.mark.gpu
def test_on_a_gpu_auto_keeps_fsdp_for_bf16_and_never_refuses_it():
    """bf16 compute on the GPU comes from FSDP2's policy: auto keeps fully_shard at world 1, never says why not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    options = {**pinned_options(), "device": "cuda", "mixed_precision": "bfloat16"}
    with local_rank(options, device="cuda") as worker:
        assert worker._fsdp and worker.model.get_input_embeddings().weight.to_local().dtype == torch.float32
    with pytest.raises(ValueError, match="shard: never has no bf16 compute on the GPU"):
        with local_rank({**options, "shard": "never"}, device="cuda"):
            pass
    with local_rank({**options, "mixed_precision": "float32"}, device="cuda") as worker:
        assert worker._fsdp == [] and worker.model.get_input_embeddings().weight.device.type == "cuda"


def _greedy(lengths: list[int], budget: int) -> list[list[int]]:
    """The rule of ``micro_batches`` row by row: longest first, add a row while rows x longest <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # sorted() is stable, as argsort(stable=True)
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=40), st.integers(1, 64))
def test_micro_batches_are_the_row_by_row_greedy_plan(lengths, budget):
    got = [m.tolist() for m in micro_batches(torch.tensor(lengths, dtype=torch.int64), budget)]
    assert got == _greedy(lengths, budget)
