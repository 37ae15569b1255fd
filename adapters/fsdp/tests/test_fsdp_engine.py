"""Tests of the ``fsdp`` train engine on a tiny random Qwen2, on CPU with gloo, at world size 1 and 2.

The conformance suite runs at both world sizes; the direct tests compare the
engine with an independent oracle: a plain Hugging Face forward/backward in
this process, on the same seed-built weights.

CI runs these through tests/adapters/test_fsdp.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess

import pytest
import torch
from asyncflow_spec import TrainEngineSpec
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core import columns as C
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import AsyncflowError, EngineError
from asyncflow_core.interfaces import LossContext
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_fsdp.packing import micro_batches, plan_step, split_across_ranks
from asyncflow_fsdp.testing import TINY_QWEN2, FailingAlgorithm, GRPOWithValueLoss, tiny_options
from asyncflow_plugins.hf.model import build_causal_lm
from asyncflow_core.types.sampling import sampling_logprobs

VOCAB = TINY_QWEN2["vocab_size"]


# ------------------------------------------------------------------ conformance


class TestFSDPWorld1(TrainEngineSpec):
    backend = "fsdp"
    options = tiny_options(world_size=1)


class TestFSDPWorld2(TrainEngineSpec):
    backend = "fsdp"
    options = tiny_options(world_size=2)


# ------------------------------------------------------------------ helpers


def run(coro, timeout: float = 180.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make(**options):
    return get_plugin_manager().create("train_engine", "fsdp", tiny_options(**options))


def grpo():
    return get_plugin_manager().create("algorithm", "grpo", {})


def sample_batch(rows: int = 7, seed: int = 0) -> Batch:
    """Rows of uneven prompt and response lengths (so padding, packing and empty passes all happen)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (2 + i % 4,), generator=gen) for i in range(rows)]
    responses = [torch.randint(0, VOCAB, (1 + (3 * i) % 5,), generator=gen) for i in range(rows)]
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
        C.RESPONSE_IDS: RaggedTensor.from_sequences(responses),
        C.REWARD: (torch.arange(rows) % 3 == 0).float(),
        C.GROUP_ID: torch.arange(rows) // 3,
    })


def oracle_logprobs(net, batch: Batch, temperature=1.0, top_p=1.0, top_k=-1) -> torch.Tensor:
    """Each row alone through a plain HF forward, then the shared sampling convention."""
    out = []
    for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
        ids = torch.cat([prompt, response]).unsqueeze(0)
        logits = net(input_ids=ids).logits[0].float()
        p = prompt.numel()
        lp = sampling_logprobs(logits[p - 1 : p - 1 + response.numel()], temperature, top_p, top_k)
        out.append(lp.gather(1, response.unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def with_advantages(batch: Batch, logp: RaggedTensor, algo) -> Batch:
    return algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: logp}))


def model_config() -> ModelConfig:
    return ModelConfig(hf_config=dict(TINY_QWEN2))


# ------------------------------------------------------------------ numerics


def test_logprobs_follow_the_sampling_convention_of_a_plain_hf_forward():
    """Padding, logits_to_keep and micro-batching change nothing: log-probs equal an unpadded HF forward."""
    convention = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}

    async def body():
        engine = make(world_size=1, micro_batch_tokens=16, **convention)
        await engine.setup()
        try:
            batch = sample_batch()
            got = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        finally:
            await engine.shutdown()
        return batch, got

    batch, got = run(body())
    net = build_causal_lm(model_config(), seed=0)
    with torch.no_grad():
        want = oracle_logprobs(net, batch, **convention)
    assert torch.equal(got.offsets, batch[C.RESPONSE_IDS].offsets)
    assert torch.isinf(want).any(), "the batch should hit tokens cut by top-k/top-p"
    assert torch.allclose(got.values, want, atol=1e-5), (got.values - want).abs().nan_to_num().max()


def test_world2_step_equals_world1_step_and_the_full_batch_oracle():
    """Loss and grad norm of one step equal the plain full-batch loss at world 1 (one micro-batch) and world 2
    (many micro-batches, uneven per rank); the updated weights agree too."""
    algo = grpo()

    async def step(world: int, budget: int):
        engine = make(world_size=world, micro_batch_tokens=budget, temperature=0.8)
        await engine.setup()
        try:
            batch = sample_batch()
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            metrics = await engine.train_step(train, algo)
            after = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            return train, metrics, after, engine.version
        finally:
            await engine.shutdown()

    train1, m1, after1, v1 = run(step(1, 10_000))
    train2, m2, after2, v2 = run(step(2, 12))
    assert v1 == v2 == 1
    assert m2["micro_batches"] > 1

    net = build_causal_lm(model_config(), seed=0)
    resp = train1[C.RESPONSE_IDS]
    logp = oracle_logprobs(net, train1, temperature=0.8)
    ctx = LossContext(global_tokens=resp.numel_packed, global_sequences=train1.num_rows, policy_version=0)
    loss, _ = algo.loss(RaggedTensor(logp, resp.offsets), train1, ctx)
    loss.backward()
    loss = loss.detach()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters() if p.grad is not None]))

    for m in (m1, m2):
        assert m["loss"] == pytest.approx(float(loss), abs=1e-6)
        assert m["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert torch.allclose(after1.values, after2.values, atol=1e-5)


def test_export_weights_load_into_a_fresh_hf_model_and_export_hf_round_trip(tmp_path):
    """Buckets gathered from two ranks carry every HF parameter; a fresh model loaded from them, and the
    save_pretrained directory, give the same logits as each other and the engine's log-probs."""
    from transformers import AutoModelForCausalLM

    algo = grpo()

    async def body():
        engine = make(world_size=2, micro_batch_tokens=20)
        await engine.setup()
        try:
            batch = sample_batch()
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(with_advantages(batch, lp, algo), algo)
            buckets = [b async for b in engine.export_weights(bucket_bytes=4096)]
            await engine.export_pretrained(tmp_path / "hf")
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            return batch, buckets, lp
        finally:
            await engine.shutdown()

    batch, buckets, engine_lp = run(body())
    assert len(buckets) > 2 and buckets[-1].last and [b.index for b in buckets] == list(range(len(buckets)))
    fresh = build_causal_lm(model_config(), seed=123)  # different random weights until loaded
    received = {}
    for b in buckets:
        assert b.version == 1
        b.verify()
        received.update({name: t.clone() for name, t in b.tensors()})
    assert set(received) == set(fresh.state_dict())
    fresh.load_state_dict(received)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    ids = torch.cat([batch[C.PROMPT_IDS][0], batch[C.RESPONSE_IDS][0]]).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, exported.eval()(input_ids=ids).logits)
        assert torch.allclose(oracle_logprobs(fresh, batch), engine_lp.values, atol=1e-5)


def test_dcp_checkpoint_resumes_weights_optimizer_and_version_at_any_world_size(tmp_path):
    """save at world 2 -> load at world 2 continues bit-for-bit like the uninterrupted engine (optimizer state
    included); load at world 1 (resharded) restores the same weights and version."""
    algo = grpo()
    batch = sample_batch()

    async def two_steps_with_save():
        engine = make(world_size=2, micro_batch_tokens=20)
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            await engine.train_step(train, algo)
            await engine.save(tmp_path / "ckpt")
            at_save = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(train, algo)
            return train, at_save, (await engine.compute_logprobs(batch))[C.LOGPROBS]
        finally:
            await engine.shutdown()

    async def resume(world: int, train):
        engine = make(world_size=world, micro_batch_tokens=20)
        await engine.setup()
        try:
            await engine.load(tmp_path / "ckpt")
            assert engine.version == 1
            restored = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(train, algo)
            assert engine.version == 2
            return restored, (await engine.compute_logprobs(batch))[C.LOGPROBS]
        finally:
            await engine.shutdown()

    train, at_save, after_two = run(two_steps_with_save())
    restored, continued = run(resume(2, train))
    assert torch.allclose(restored.values, at_save.values, atol=1e-6)
    assert torch.allclose(continued.values, after_two.values, atol=1e-6)
    restored1, continued1 = run(resume(1, train))
    assert torch.allclose(restored1.values, at_save.values, atol=1e-5)
    assert torch.allclose(continued1.values, after_two.values, atol=1e-4)


def test_value_head_values_and_value_loss():
    """value_head: true declares supports_values, returns aligned values, and the algorithm's value_loss trains it."""
    algo = GRPOWithValueLoss()

    async def body():
        engine = make(world_size=2, value_head=True, lr=5e-2)
        assert engine.features.supports_values
        await engine.setup()
        try:
            batch = sample_batch()
            out = await engine.compute_logprobs(batch, values=True)
            values = out[C.VALUES]
            assert torch.equal(values.offsets, batch[C.RESPONSE_IDS].offsets)
            assert torch.count_nonzero(values.values) == 0  # the head starts at zero
            metrics = await engine.train_step(with_advantages(batch, out[C.LOGPROBS], algo), algo)
            assert metrics["algo/value_loss"] > 0
            after = (await engine.compute_logprobs(batch, values=True))[C.VALUES]
            assert torch.count_nonzero(after.values) > 0
        finally:
            await engine.shutdown()

    run(body())


# ------------------------------------------------------------------ failures


def test_a_killed_rank_is_an_engine_error_and_every_rank_is_reaped():
    async def body():
        engine = make(world_size=2)
        await engine.setup()
        pids = engine.rank_pids
        try:
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(EngineError, match=r"rank 1 .* died: killed by signal SIGKILL"):
                await engine.compute_logprobs(sample_batch())
            with pytest.raises(EngineError, match="earlier failure"):
                await engine.compute_logprobs(sample_batch())
        finally:
            await engine.shutdown()
        return pids

    for pid in run(body()):
        assert not _alive(pid)


def test_a_rank_that_stops_answering_times_out_with_the_reason():
    async def body():
        engine = make(world_size=2, timeout_s=2.0)
        await engine.setup()
        pids = engine.rank_pids
        try:
            os.kill(pids[1], signal.SIGSTOP)
            with pytest.raises(EngineError, match=r"rank\(s\) \[(0, )?1\] did not answer within 2 s"):
                await engine.compute_logprobs(sample_batch())
        finally:
            await engine.shutdown()
        return pids

    for pid in run(body()):
        assert not _alive(pid)


def test_an_exception_on_a_rank_is_an_engine_error_with_its_traceback():
    from asyncflow_fsdp.ranks import RankError

    async def body():
        engine = make(world_size=2)
        await engine.setup()
        try:
            batch = sample_batch()
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            with pytest.raises(RankError, match=r"train_step: rank \d raised RuntimeError: deliberate") as info:
                await engine.train_step(with_advantages(batch, lp, grpo()), FailingAlgorithm())
            assert "deliberate failure in loss" in info.value.remote_traceback
            assert engine.version == 0
        finally:
            await engine.shutdown()

    run(body())


def test_spawn_start_method_gives_the_same_log_probs():
    """start_method=spawn (fresh interpreters) is a drop-in for the default forkserver."""

    async def logprobs(start_method: str):
        engine = make(world_size=1, start_method=start_method)
        await engine.setup()
        try:
            return (await engine.compute_logprobs(sample_batch()))[C.LOGPROBS].values
        finally:
            await engine.shutdown()

    assert torch.equal(run(logprobs("spawn")), run(logprobs("forkserver")))


def test_bad_input_is_refused_before_it_reaches_the_ranks():
    algo = grpo()

    async def body():
        engine = make(world_size=1)
        await engine.setup()
        try:
            batch = sample_batch()
            bad = batch.with_columns(**{C.RESPONSE_IDS: RaggedTensor(batch[C.RESPONSE_IDS].values + VOCAB,
                                                                     batch[C.RESPONSE_IDS].offsets)})
            with pytest.raises(ValueError, match="outside the model's vocabulary"):
                await engine.compute_logprobs(bad)
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            shifted = RaggedTensor.from_sequences([s[:-1] if s.numel() > 1 else s for s in train[C.ADVANTAGES]])
            with pytest.raises(ValueError, match="advantages is not aligned"):
                await engine.train_step(train.with_columns(**{C.ADVANTAGES: shifted}), algo)
            with pytest.raises(EngineError, match="no complete fsdp checkpoint"):
                await engine.load("/nonexistent/ckpt")
            assert engine.version == 0
            await engine.train_step(train, algo)  # still usable
            assert engine.version == 1
        finally:
            await engine.shutdown()

    run(body())
    with pytest.raises(AsyncflowError, match="world_size"):
        get_plugin_manager().create("train_engine", "fsdp", {"world_size": 0})
    with pytest.raises(AsyncflowError, match="nonsense"):
        get_plugin_manager().create("train_engine", "fsdp", {"nonsense": 1})
    engine = get_plugin_manager().create("train_engine", "fsdp", {})
    with pytest.raises(EngineError, match="no model"):
        run(engine.setup())
    engine = get_plugin_manager().create("train_engine", "fsdp", {"model": {}})
    with pytest.raises(EngineError, match="no model"):
        run(engine.setup())


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss to list sockets")
def test_ranks_use_loopback_sockets_only():
    """The rendezvous store and gloo's own sockets are bound to 127.0.0.1: no traffic leaves the host."""

    async def body():
        engine = make(world_size=2)
        await engine.setup()
        try:
            await engine.compute_logprobs(sample_batch())
            out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True).stdout
            return [line for line in out.splitlines() if any(f"pid={p}," in line for p in engine.rank_pids)]
        finally:
            await engine.shutdown()

    lines = run(body())
    assert lines, "the ranks should hold TCP sockets"
    for line in lines:
        local, peer = line.split()[3], line.split()[4]
        for addr in (local, peer):
            host = addr.rpartition(":")[0]
            assert host in ("127.0.0.1", "[::ffff:127.0.0.1]", "*", "0.0.0.0") or addr.endswith(":*"), line
        assert local.rpartition(":")[0] in ("127.0.0.1", "[::ffff:127.0.0.1]"), line


def test_registered_through_the_entry_point():
    registered = get_plugin_manager().lookup("train_engine", "fsdp")
    assert registered.distribution == "asyncflow-fsdp"
    assert registered.record.features.supports_hf_export


# ------------------------------------------------------------------ planning (pure)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(1, 4), st.integers(1, 64))
def test_plan_partitions_rows_and_respects_the_budget(lengths, world, budget):
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    plan = plan_step(lengths_t, world, budget)
    rows = torch.cat(plan.rank_rows).sort().values if lengths else torch.empty(0, dtype=torch.int64)
    assert rows.tolist() == list(range(len(lengths)))
    for rank_rows, mbs in zip(plan.rank_rows, plan.rank_micro_batches, strict=True):
        inside = torch.cat(mbs).sort().values.tolist() if mbs else []
        assert inside == list(range(len(rank_rows)))
        for mb in mbs:
            lens = lengths_t[rank_rows][mb]
            assert mb.numel() == 1 or mb.numel() * int(lens.max()) <= budget
    assert plan.passes == max(1, *(len(m) for m in plan.rank_micro_batches))


def test_rows_are_balanced_by_tokens():
    lengths = torch.tensor([3, 7, 1, 5, 4])
    parts = split_across_ranks(lengths, 2)
    assert [int(lengths[p].sum()) for p in parts] == [10, 10]
    assert [m.tolist() for m in micro_batches(torch.tensor([5, 1, 4]), 8)] == [[0], [2, 1]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes, but the engine joins its processes, so none should remain
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
