"""The ``torch`` engine decodes sequences with identical contexts as one row (``share_contexts``, the default).

The n samples of a prompt share its prefill row, and keep sharing a row for as
long as their tokens agree; a row splits where they sample different tokens.
A shortcut of the general path (``share_contexts=False``: one row per
sequence), so these tests run both on the same requests and compare them:
the same tokens, finish reasons and versions, log-probs equal to float
rounding, and fewer rows through the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams
from asyncflow_spec.base import run
import test_torch_rollout
from test_torch_rollout import TINY, assert_teacher_forced, collect, reference, request, started

_one_cpu_thread = test_torch_rollout._one_cpu_thread  # its autouse fixture: one torch thread here too


#: wider initial weights than TINY's (as the arithmetic example's): a peaked policy, whose samples often agree
PEAKED = {**TINY, "initializer_range": 0.2}


def _requests() -> list[GenerationRequest]:
    """Groups of samples of one prompt (as GRPO sends them), of different lengths, sampling settings and seeds."""
    cold = {"temperature": 0.3, "max_new_tokens": 9}  # cold: a group's samples agree for a while
    reqs = [request(f"a{i}", prompt=(5, 6, 7), **cold) for i in range(8)]
    reqs += [request(f"b{i}", prompt=(9, 1), temperature=0.5, max_new_tokens=7) for i in range(6)]
    reqs += [request(f"c{i}", prompt=(2, 3, 4, 5, 6), stop_token_ids=(11, 17, 23), temperature=1.3, top_k=9,
                     max_new_tokens=8) for i in range(5)]
    reqs += [request(f"s{i}", prompt=(5, 6, 7), seed=3, max_new_tokens=6) for i in range(3)]  # own generators
    reqs.append(request("lone", prompt=(8,), top_p=0.8, max_new_tokens=10))
    return reqs


def _generate(share: bool, *, double: bool, device: str = "cpu") -> tuple[dict, list[int]]:
    """Results by request id and the rows of each forward pass, with sharing on or off.

    ``double``: the model in float64, so that the two paths' different orders of additions (a matmul over more
    or fewer rows) round to the same float32 logits and cannot flip a sampled token between them.
    """
    rows: list[int] = []

    async def body():
        engine = await started(model={"hf_config": PEAKED}, max_batch=12, share_contexts=share, seed=5, device=device)
        if double:
            engine._net.double()
        forward = engine._forward

        def spy(ids, *args):
            rows.append(ids.shape[0])
            return forward(ids, *args)

        engine._forward = spy
        try:
            return {r.request_id: r for r in await collect(engine.generate(_requests()))}
        finally:
            await engine.shutdown()

    return run(body()), rows


@pytest.mark.parametrize("double", [True, False], ids=["float64", "float32"])
def test_shared_rows_sample_what_one_row_per_sequence_samples(double):
    shared, shared_rows = _generate(True, double=double)
    alone, alone_rows = _generate(False, double=double)
    assert shared.keys() == alone.keys() == {r.request_id for r in _requests()}
    # fewer rows went through the model (the near-greedy group shares its row), in as many forward passes
    # (float32 may flip a token between the two paths, which changes when rows finish: compared in float64)
    assert sum(shared_rows) < sum(alone_rows)
    if double:
        assert len(shared_rows) == len(alone_rows)
    net = reference(hf=PEAKED)
    for rid, res in shared.items():
        sampling = next(r.sampling for r in _requests() if r.request_id == rid)
        if double:
            # float64 logits of the two paths differ by a few float64 roundings (~1e-16 relative), far below
            # float32's (6e-8): cast to float32 (the engine samples in float32) they are the same numbers, unless
            # one lies within 1e-16 of a float32 rounding boundary (odds ~1e-8 a logit). So: the same tokens, the
            # same log-probs to the bit, the same finish reasons and versions
            other = alone[rid]
            assert tuple(res.token_ids) == tuple(other.token_ids), rid
            assert tuple(res.logprobs) == tuple(other.logprobs), rid
            assert res.finish_reason is other.finish_reason and tuple(res.versions) == tuple(other.versions)
        else:  # float32: every log-prob still matches one full forward over prompt + completion
            assert_teacher_forced(net, res, sampling)
            assert_teacher_forced(net, alone[rid], sampling)
    # the samples of the cold group agree on their first tokens, and the hot groups do split
    assert len({tuple(shared[f"a{i}"].token_ids[:2]) for i in range(8)}) < 8
    assert len({tuple(shared[f"b{i}"].token_ids) for i in range(6)}) > 1
    assert len({tuple(shared[f"s{i}"].token_ids) for i in range(3)}) == 1  # one seed, one stream each


def test_aborting_some_samples_of_a_shared_row_keeps_the_others_decoding():
    """Samples sharing a row (near greedy) lose some members to abort: those come back partial, the rest finish,
    and every log-prob matches teacher forcing."""
    sampling = SamplingParams(max_new_tokens=200, temperature=0.01)
    net = reference()

    async def body():
        engine = await started()
        try:
            reqs = [request("short", max_new_tokens=3)]
            reqs += [GenerationRequest(f"g{i}", (4, 4, 2), sampling) for i in range(5)]
            stream = engine.generate(reqs)
            first = await stream.__anext__()
            assert first.request_id == "short"
            assert await engine.abort(["g0", "g3"]) == ["g0", "g3"]
            return [r async for r in stream]
        finally:
            await engine.shutdown()

    results = {r.request_id: r for r in run(body())}
    assert {results[k].finish_reason for k in ("g0", "g3")} == {FinishReason.ABORT}
    assert {results[k].finish_reason for k in ("g1", "g2", "g4")} == {FinishReason.LENGTH}
    for key in ("g0", "g3"):
        assert 3 <= len(results[key].token_ids) < 200
    for res in results.values():
        assert_teacher_forced(net, res, sampling)


def test_shared_rows_stop_at_the_model_context_limit():
    """Samples of one prompt near the model's context limit share a row and all stop there with reason length."""
    hf = {**TINY, "max_position_embeddings": 8}

    async def body():
        engine = await started(model={"hf_config": hf})
        try:
            reqs = [request(f"x{i}", prompt=(1, 2, 3, 4, 5), temperature=0.01, max_new_tokens=50) for i in range(4)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body())
    assert {r.finish_reason for r in results} == {FinishReason.LENGTH}
    assert {len(r.token_ids) for r in results} == {3}  # positions 5, 6, 7: the context is full
    net = reference(hf=hf)
    for res in results:
        assert_teacher_forced(net, res, SamplingParams(temperature=0.01))


def test_the_engine_benchmark_reports_cpu_and_rows_per_batch_for_both_settings():
    """benchmarks/profile_step.py --engine-step: the example's batch through the engine, shared and unshared rows
    (structure and row counts only, never timings)."""
    pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_step.py"), "--engine-step", "--batches",
                           "2", "--repeats", "1", "--json"], capture_output=True, text=True, cwd=root, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["requests_per_batch"] == 256 and res["batches"] == 2 and res["torch_threads"] == 1
    shared, unshared = res["engine_batch_cpu_s"]["shared"], res["engine_batch_cpu_s"]["unshared"]
    for r in (shared, unshared):
        assert r["median"] > 0 and r["wall_s_median"] > 0 and len(r["repeats"]) == 1
        assert 1 <= r["forwards_per_batch"] <= 3  # a prefill, then a decode per further token (3 at most)
    # a prefill runs the distinct prompts (32 at most); without sharing, a decode runs every sequence still going
    assert 32 <= shared["forward_rows_per_batch"] < unshared["forward_rows_per_batch"] <= 32 + 2 * 256


@pytest.mark.gpu
def test_shared_rows_on_cuda_sample_what_one_row_per_sequence_samples():
    """The CUDA path of shared rows (fixed by reading torch 2.13, never run): the row map, the parents' index and
    the pending tokens live on the device, sampling draws from the engine's CUDA generator. In float64 both paths
    give the same tokens and log-probs, and fewer rows go through the model."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shared, shared_rows = _generate(True, double=True, device="cuda")
    alone, alone_rows = _generate(False, double=True, device="cuda")
    assert sum(shared_rows) < sum(alone_rows) and len(shared_rows) == len(alone_rows)
    for rid, res in shared.items():
        other = alone[rid]
        assert tuple(res.token_ids) == tuple(other.token_ids) and tuple(res.logprobs) == tuple(other.logprobs), rid

