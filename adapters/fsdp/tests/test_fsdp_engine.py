"""Tests of the ``fsdp`` train engine on a tiny random Qwen2, on CPU with gloo, at world size 1 and 2.

The conformance suite runs at both world sizes; the direct tests compare the
engine with an independent oracle: a plain Hugging Face forward/backward in
this process, on the same seed-built weights.

Every engine here is pinned to the CPU in float32 (``pinned_options``): with
``device: auto`` a CUDA host would run world 1 in bfloat16 on its GPU while
the float32 oracle comparisons expect CPU float32. Comparisons of floats
allow for rounding order: thread counts, BLAS kernels, the CPU's vector width
and the split over ranks change the order of additions, so two correct runs
differ by their rounding errors. Tolerances are derived from the quantity
(:func:`rounding_tol`), never a fixed 1e-5.

CI runs these through tests/adapters/test_fsdp.py.
"""

from __future__ import annotations

import asyncio
import math
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
from asyncflow_core.processes import pid_alive
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_fsdp.packing import micro_batches, plan_step, split_across_ranks
from asyncflow_fsdp.testing import TINY_QWEN2, FailingAlgorithm, GRPOWithValueLoss, tiny_options
from asyncflow_plugins.hf.model import build_causal_lm
from asyncflow_core.types.sampling import sampling_logprobs

VOCAB = TINY_QWEN2["vocab_size"]


def pinned_options(**overrides) -> dict:
    """Options of a CPU float32 engine on TINY_QWEN2: no machine (a CUDA host with device auto) picks another path."""
    return tiny_options(**{"model": {"hf_config": dict(TINY_QWEN2), "dtype": "float32"}, "device": "cpu",
                           "mixed_precision": "float32", "export_dtype": "float32", **overrides})


# ------------------------------------------------------------------ tolerances

#: float32 unit roundoff: the largest relative error of one rounding
U32 = torch.finfo(torch.float32).eps / 2
#: Higham & Mary, "A new approach to probabilistic rounding error analysis" (SIAM J. Sci. Comput. 41(5), 2019):
#: n additions in any order err by at most LAMBDA * sqrt(n) * u times the size of their terms, with probability
#: at least 1 - 2n exp(-LAMBDA^2 / 2), i.e. 1 - 3e-8 n at LAMBDA = 6
LAMBDA = 6.0
#: additions on the path from the input to one log-prob of TINY_QWEN2: per layer two RMSNorms, the q/k/v,
#: attention-output and gate/up projections (hidden_size each), scores and weighted values (at most hidden_size
#: together), the down projection (intermediate_size); then the final norm, the head and the log-softmax
FORWARD_TERMS = (TINY_QWEN2["num_hidden_layers"] * (6 * TINY_QWEN2["hidden_size"] + TINY_QWEN2["intermediate_size"])
                 + 2 * TINY_QWEN2["hidden_size"] + VOCAB)
#: Adam's first step moves a weight by lr * g / (|g| + eps), whose slope in g is at most lr / eps. With the
#: default eps 1e-8 and lr 1e-2 that slope is 1e6: a gradient that is rounding noise (the key bias in RoPE's
#: slowest dimensions has |g| ~ 1e-9) becomes a step of up to +-lr whose size and sign depend on the CPU's
#: kernels. Tests that compare weights or log-probs after a step across world sizes use eps = lr (slope <= 1).
STEP = {"lr": 1e-3, "eps": 1e-3}


def rounding_tol(terms: int, magnitude: float) -> float:
    """How far two float32 computations of one quantity may differ when only the order of additions differs.

    ``terms`` is the number of additions on the quantity's longest path and ``magnitude`` the size of its
    terms; each computation errs by at most ``LAMBDA * sqrt(terms) * u * magnitude``, their difference by twice.
    """
    return 2 * LAMBDA * math.sqrt(terms) * U32 * magnitude


def logprob_tol(logprobs: torch.Tensor) -> float:
    """Log-probs of one forward pass, in two orders of addition (their size is the log-softmax's)."""
    return rounding_tol(FORWARD_TERMS, float(logprobs[torch.isfinite(logprobs)].abs().max()))


def grad_tol(batch: Batch, clip: float = 1.0) -> float:
    """One gradient element (clipped to the global norm ``clip``): backward and forward paths, summed over the
    batch's positions."""
    positions = batch[C.PROMPT_IDS].numel_packed + batch[C.RESPONSE_IDS].numel_packed
    return rounding_tol(2 * FORWARD_TERMS + positions, clip)


def assert_same_weights(got: dict, want: dict, batch: Batch, what: str, slope: float = 1.0) -> None:
    """Weights after ``STEP`` steps agree to the steps' slope in the gradient times the gradient's rounding error."""
    assert set(got) == set(want), what
    for name, tensor in want.items():
        tol = slope * STEP["lr"] / STEP["eps"] * grad_tol(batch) + 2 * U32 * float(tensor.abs().max())
        diff = float((got[name].double() - tensor.double()).abs().max())
        assert diff <= tol, (what, name, diff, tol)


# ------------------------------------------------------------------ conformance


class TestFSDPWorld1(TrainEngineSpec):
    backend = "fsdp"
    options = pinned_options(world_size=1)


class TestFSDPWorld2(TrainEngineSpec):
    backend = "fsdp"
    options = pinned_options(world_size=2)


# ------------------------------------------------------------------ helpers


def run(coro, timeout: float = 180.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make(**options):
    return get_plugin_manager().create("train_engine", "fsdp", pinned_options(**options))


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
        logits = net(input_ids=ids).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least, float64 kept
        p = prompt.numel()
        lp = sampling_logprobs(logits[p - 1 : p - 1 + response.numel()], temperature, top_p, top_k)
        out.append(lp.gather(1, response.unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def with_advantages(batch: Batch, logp: RaggedTensor, algo) -> Batch:
    return algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: logp}))


def model_config() -> ModelConfig:
    return ModelConfig(hf_config=dict(TINY_QWEN2))


async def exported(engine) -> dict[str, torch.Tensor]:
    """The engine's full weights, gathered from its ranks."""
    return {name: t.clone() async for b in engine.export_weights(bucket_bytes=1 << 20) for name, t in b.tensors()}


def oracle_step(train: Batch, algo, temperature: float, max_grad_norm: float = 1.0):
    """Full-batch loss, gradient norm and weights after one clipped Adam ``STEP`` of a plain HF model, in float64
    (the oracle's own rounding is negligible next to the engine's float32)."""
    net = build_causal_lm(model_config(), seed=0).double()
    resp = train[C.RESPONSE_IDS]
    logp = oracle_logprobs(net, train, temperature=temperature)
    ctx = LossContext(global_tokens=resp.numel_packed, global_sequences=train.num_rows, policy_version=0)
    loss, _ = algo.loss(RaggedTensor(logp, resp.offsets), train, ctx)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
    torch.optim.AdamW(net.parameters(), weight_decay=0.0, **STEP).step()
    return float(loss.detach()), float(norm), {k: v.detach() for k, v in net.state_dict().items()}


def boundary_margin(net, batch: Batch, temperature: float, top_p: float, top_k: int) -> float:
    """How far the batch's scored positions are from a top-k tie (in scaled logits) or a top-p boundary (in mass).

    A token near either boundary could be kept by one rounding and cut (-inf) by another; a margin above
    the log-prob tolerance means rounding cannot change which tokens the convention keeps.
    """
    margins = []
    for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
        with torch.no_grad():
            logits = net(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0].float()
        scaled = logits[prompt.numel() - 1: prompt.numel() - 1 + response.numel()] / temperature
        top = scaled.sort(dim=-1, descending=True).values
        margins.append((top[:, top_k - 1] - top[:, top_k]).min())
        kept = sampling_logprobs(logits[prompt.numel() - 1: prompt.numel() - 1 + response.numel()], temperature,
                                 top_k=top_k).exp().sort(dim=-1, descending=True).values
        before = kept.cumsum(-1) - kept  # the mass ahead of each token: cut where it reaches top_p
        margins.append((before - top_p).abs().min())  # a mass errs by at most its log-probs' error (mass <= 1)
    return float(torch.stack(margins).min())


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
    tol = logprob_tol(want)
    assert boundary_margin(net, batch, **convention) > tol, "a token sits on a top-k/top-p boundary: change the seed"
    assert torch.allclose(got.values, want, rtol=0, atol=tol), (got.values - want).abs().nan_to_num().max()


def test_world2_step_equals_world1_step_and_the_full_batch_oracle():
    """Loss, grad norm and every updated weight of one step equal the plain full-batch oracle's (float64, the
    same clipping and AdamW step) at world 1 (one micro-batch) and world 2 (many micro-batches, uneven per
    rank); the log-probs after the step are those of the updated weights.

    The step uses eps = lr (``STEP``): AdamW's first step is then a function of the gradient with slope at
    most 1, so comparing weights compares the gradients, element by element. With the default eps 1e-8 the
    comparison would be of rounding noise in near-zero gradients, amplified up to 1e6 times.
    """
    algo = grpo()

    async def step(world: int, budget: int):
        engine = make(world_size=world, micro_batch_tokens=budget, temperature=0.8, **STEP)
        await engine.setup()
        try:
            batch = sample_batch()
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            metrics = await engine.train_step(train, algo)
            after = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            return train, lp, metrics, after, await exported(engine), engine.version
        finally:
            await engine.shutdown()

    results = {1: run(step(1, 10_000)), 2: run(step(2, 12))}
    assert results[2][2]["micro_batches"] > 1
    for world, (train, before, m, after, weights, version) in results.items():
        assert version == 1
        loss, norm, want = oracle_step(train, algo, temperature=0.8)
        adv = float(train[C.ADVANTAGES].values.abs().mean())
        tokens = train[C.RESPONSE_IDS].numel_packed
        # the loss averages advantage-weighted ratios: the log-probs' error times the mean |advantage|, plus the mean
        assert m["loss"] == pytest.approx(loss, abs=adv * logprob_tol(before.values) + rounding_tol(tokens, adv))
        assert m["grad_norm"] == pytest.approx(norm, rel=grad_tol(train)), world
        assert_same_weights(weights, want, train, f"world {world} vs oracle")
        net = build_causal_lm(model_config(), seed=0)
        net.load_state_dict(weights)
        with torch.no_grad():
            scored = oracle_logprobs(net, train, temperature=0.8)
        assert torch.allclose(after.values, scored, rtol=0, atol=logprob_tol(scored)), world
        moved = (after.values - before.values).abs().max()
        assert moved > 100 * logprob_tol(before.values), "the step should move the log-probs visibly"


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

    from_disk = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(from_disk).__name__ == "Qwen2ForCausalLM"
    ids = torch.cat([batch[C.PROMPT_IDS][0], batch[C.RESPONSE_IDS][0]]).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, from_disk.eval()(input_ids=ids).logits)  # same weights, order
        want = oracle_logprobs(fresh, batch)
        assert torch.allclose(want, engine_lp.values, rtol=0, atol=logprob_tol(want))


def test_dcp_checkpoint_resumes_weights_optimizer_and_version_at_any_world_size(tmp_path):
    """save at world 2 -> load at world 2 or world 1 (resharded) restores the weights and version, and the next
    step (optimizer state included) updates the weights as the uninterrupted engine's second step did.

    Log-probs agree to rounding; weights after the second ``STEP`` to the step's slope in the gradient
    (AdamW's second step: at most 1.5 lr / eps) times the gradient's rounding. A lost optimizer state (moments
    or step count) changes that step by a good part of lr, far above the tolerance.
    """
    algo = grpo()
    batch = sample_batch()

    async def two_steps_with_save():
        engine = make(world_size=2, micro_batch_tokens=20, **STEP)
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            await engine.train_step(train, algo)
            await engine.save(tmp_path / "ckpt")
            at_save = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(train, algo)
            return train, at_save, await exported(engine)
        finally:
            await engine.shutdown()

    async def resume(world: int, train):
        engine = make(world_size=world, micro_batch_tokens=20, **STEP)
        await engine.setup()
        try:
            await engine.load(tmp_path / "ckpt")
            assert engine.version == 1
            restored = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(train, algo)
            assert engine.version == 2
            return restored, (await engine.compute_logprobs(batch))[C.LOGPROBS], await exported(engine)
        finally:
            await engine.shutdown()

    train, at_save, weights_two = run(two_steps_with_save())
    for world in (2, 1):
        restored, continued, weights = run(resume(world, train))
        assert torch.allclose(restored.values, at_save.values, rtol=0, atol=logprob_tol(at_save.values)), world
        assert_same_weights(weights, weights_two, train, f"world {world} resumed", slope=1.5)
        net = build_causal_lm(model_config(), seed=0)
        net.load_state_dict(weights)
        with torch.no_grad():
            scored = oracle_logprobs(net, batch)
        assert torch.allclose(continued.values, scored, rtol=0, atol=logprob_tol(scored)), world


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
        assert not pid_alive(pid)


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
        assert not pid_alive(pid)


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


def test_cpu_ranks_leave_this_process_the_other_cores_and_shutdown_gives_them_back():
    """CPU ranks as child processes take ``cpu_threads_per_rank`` threads each; the driver's process (where a
    rollout engine generates beside them) keeps to the cores left, at least one, and gets its count back at
    shutdown. Holds on any core count: with every core in use before, the count during is exactly what is left."""
    from asyncflow_core.launchers.ranks import driver_cpu_threads

    cores = os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # torch's default on most hosts: every core
    try:
        engine = make(cpu_threads_per_rank=1)

        async def main():
            await engine.setup()
            try:
                return torch.get_num_threads(), engine.config.world_size
            finally:
                await engine.shutdown()

        during, world = run(main())
        assert during == min(cores, driver_cpu_threads(world, 1)) == min(cores, max(1, cores - world)), during
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)

