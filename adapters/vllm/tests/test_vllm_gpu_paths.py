"""The GPU paths of the ``vllm`` engine, tested where no GPU is needed.

Four parts of the adapter only matter on CUDA (the NCCL weight group's device
and deadline, sleep mode, readback of vocabulary shards at tensor-parallel
size > 1); ``test_vllm_gpu.py`` runs them on CUDA. What decides their
behaviour runs here:

- pure functions (device choice, deadlines, shard rows) run in any
  environment;
- the sleep / wake / pause state machine runs against the real vLLM of
  ``.venv-vllm``: vLLM's CPU worker makes ``sleep`` and ``wake_up`` a no-op
  on memory, but the engine core's part — pausing the scheduler with a mode,
  tracking sleeping memory tags, resuming the scheduler when everything is
  awake — is vLLM's own code, the same as on CUDA. The engine's public
  ``sleep``/``wake_up`` refuse on CPU (``supports_sleep`` is false there, as
  the contract asks), so these tests call the methods behind them;
- readback runs on vLLM's real ``VocabParallelEmbedding`` / ``ParallelLMHead``
  layers, loaded through their own weight loaders. Only the rank and TP size
  they read from vLLM's distributed state are stand-ins (that state needs a
  distributed run), so each rank's shard is built as vLLM builds it.

Stand-ins for what cannot run here are named in each test's docstring.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import threading
import time
import types
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from asyncflow_vllm import weight_group
from asyncflow_vllm.config import VLLMRolloutConfig
from asyncflow_vllm.engine import VLLMRolloutEngine, engine_args
from asyncflow_vllm.testing import TINY_QWEN2, tiny_options
from asyncflow_vllm.worker import _readback, real_vocab_rows, vocab_shard_rows

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError, EngineError, UnsupportedFeatureError, WeightTransferError
from asyncflow_core.interfaces import PauseMode
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, pack_buckets

# ------------------------------------------------------------------ rank 0's device


def test_rank_0_never_shares_a_gpu_with_a_worker():
    """auto picks the first GPU no worker uses, compared by UUID (indices differ between processes)."""
    pick = weight_group.choose_weight_sync
    # TP=1: the worker is on the first GPU, the engine takes the second
    assert pick("auto", "auto", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"}) == ("nccl", "cuda:1")
    # TP=2: two workers, a third GPU is free
    assert pick("nccl", "auto", engine_device="cuda", local_uuids=["A", "B", "C"],
                worker_uuids={"A", "B"}) == ("nccl", "cuda:2")
    # this process sees the GPUs in another order (CUDA_VISIBLE_DEVICES): the UUID decides, not the index
    assert pick("auto", "auto", engine_device="cuda", local_uuids=["B", "A"], worker_uuids={"B"}) == ("nccl", "cuda:1")
    # a named GPU that no worker uses is taken as it is
    assert pick("auto", "cuda:2", engine_device="cuda", local_uuids=["A", "B", "C"],
                worker_uuids={"A"}) == ("nccl", "cuda:2")


def test_without_a_free_gpu_auto_sends_through_the_cpu_and_nccl_says_why():
    """Every visible GPU a worker's: auto falls back to gloo; nccl, or a worker's GPU by name, is a ConfigError."""
    pick = weight_group.choose_weight_sync
    assert pick("auto", "auto", engine_device="cuda", local_uuids=["A"], worker_uuids={"A"}) == ("gloo", "cpu")
    with pytest.raises(ConfigError, match="all 1 visible GPU"):
        pick("nccl", "auto", engine_device="cuda", local_uuids=["A"], worker_uuids={"A"})
    with pytest.raises(ConfigError, match="NCCL refuses two ranks of one group on one GPU"):
        pick("auto", "cuda:0", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"})
    with pytest.raises(ConfigError, match=r"sees 2 GPU\(s\)"):
        pick("auto", "cuda:5", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"})


def test_cpu_and_gloo_choices():
    """On CPU, or with gloo or the cpu device asked for, rank 0 is the CPU; contradictions are refused."""
    pick = weight_group.choose_weight_sync
    assert pick("auto", "auto", engine_device="cpu", local_uuids=[], worker_uuids=set()) == ("gloo", "cpu")
    assert pick("gloo", "auto", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"}) == ("gloo", "cpu")
    assert pick("auto", "cpu", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"}) == ("gloo", "cpu")
    with pytest.raises(ConfigError, match="vLLM runs on the CPU"):
        pick("nccl", "auto", engine_device="cpu", local_uuids=[], worker_uuids=set())
    with pytest.raises(ConfigError, match="needs the nccl backend"):
        pick("gloo", "cuda:1", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"})
    with pytest.raises(ConfigError, match="weight_sync_device is cpu"):
        pick("nccl", "cpu", engine_device="cuda", local_uuids=["A", "B"], worker_uuids={"A"})


def test_a_contradiction_needing_no_gpu_is_refused_before_vllm_starts():
    """nccl, or a named GPU, with vLLM on the CPU is a ConfigError when the engine is built (nothing is started)."""
    with pytest.raises(ConfigError, match="vLLM runs on the CPU"):
        VLLMRolloutEngine(_config(device="cpu", weight_sync_backend="nccl"))
    with pytest.raises(ConfigError, match="needs the nccl backend"):
        VLLMRolloutEngine(_config(device="cpu", weight_sync_device="cuda:1"))
    assert VLLMRolloutEngine(_config(device="cpu")).weight_sync is None  # chosen at start, from the workers' GPUs


def test_weight_sync_device_option_is_validated():
    """Only auto, cpu and cuda:N are accepted, at config load (before vLLM is imported)."""
    for good in ("auto", "cpu", "cuda:0", "cuda:12"):
        assert VLLMRolloutConfig(weight_sync_device=good).weight_sync_device == good
    for bad in ("gpu", "cuda", "cuda:x", "cuda:0,1"):
        with pytest.raises(ValueError, match="weight_sync_device"):
            VLLMRolloutConfig(weight_sync_device=bad)


# ------------------------------------------------------------------ NCCL deadline


class _RecordingNCCL:
    """Stand-in for ``torch.distributed.ProcessGroupNCCL``, which CPU builds of torch do not have.

    It records what the real constructor reads: the options object (whose
    ``_timeout`` is the watchdog's per-operation timeout) and, because torch
    reads the error-handling mode from the environment in that constructor,
    the environment at that moment.
    """

    class Options:
        def __init__(self) -> None:
            self._timeout = datetime.timedelta(minutes=10)  # torch's default (kProcessGroupNCCLDefaultTimeout)
            self.is_high_priority_stream = True

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        self.args = (store, rank, size)
        self.options = options
        self.mode_at_construction = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.mark.parametrize("before", [None, "3"])
def test_nccl_group_gets_a_backstop_timeout_and_a_mode_that_keeps_the_process(monkeypatch, before):
    """The group's options carry weight_sync_timeout_s (plus the backstop margin), and it is built with CleanUpOnly.

    ProcessGroupNCCL is replaced by a recorder (absent from CPU torch).
    Mode 3 (SkipCleanUp, torch's default) would end the process when the
    watchdog finds a failed operation; 2 (CleanUpOnly) aborts the
    communicators instead. The variable is restored after the constructor.
    """
    if before is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
    group = weight_group.nccl_group("store", 0, 3, 17.5, group_cls=_RecordingNCCL)
    assert group.args == ("store", 0, 3)
    assert group.options._timeout == datetime.timedelta(seconds=17.5 + weight_group.WATCHDOG_MARGIN_S)
    assert group.options.is_high_priority_stream is False
    assert group.mode_at_construction == weight_group.NCCL_CLEANUP_ONLY == "2"
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before


def test_a_passed_deadline_is_one_millisecond_never_no_timeout():
    """torch reads a zero timeout as "wait forever" (kNoTimeout): a deadline in the past must still end the wait."""
    assert weight_group.remaining(time.time() - 60) == datetime.timedelta(milliseconds=1)
    left = weight_group.remaining(time.time() + 30).total_seconds()
    assert 0 < left <= 30


class _Work:
    """Stand-in for a torch.distributed Work (an NCCL one needs a GPU): done after ``polls`` checks, or never."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.checked = 0
        self.waits: list[tuple] = []

    def is_completed(self) -> bool:
        self.checked += 1
        return self.polls is not None and self.checked > self.polls

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        return True


def test_an_nccl_operation_past_its_deadline_raises_without_being_marked_failed():
    """Past the deadline the wait raises TransferTimeout and never calls Work.wait (which would mark it failed).

    A failed NCCL operation sets torch's process-wide dump flag, after which
    the heartbeat monitor of the process's first group ends the process; the
    caller aborts the group instead. The works are stand-ins.
    """
    late = _Work(polls=None)
    with pytest.raises(weight_group.TransferTimeout, match="deadline"):
        weight_group.wait(late, "nccl", time.time() - 1)
    assert late.waits == [] and late.checked == 1
    done = _Work(polls=3)
    weight_group.wait(done, "nccl", time.time() + 60)
    assert done.checked == 4 and done.waits == [()]  # once complete: stream sync and NCCL errors, no timeout
    gloo = _Work(polls=None)
    weight_group.wait(gloo, "gloo", time.time() - 1)  # gloo: bounded by the group's own timeout
    assert gloo.waits == [()] and gloo.checked == 0


# ------------------------------------------------------------------ sleep mode reaches vLLM


def _config(**options: Any) -> VLLMRolloutConfig:
    return VLLMRolloutConfig(**{"model": ModelConfig(hf_config=TINY_QWEN2), **options})


def test_sleep_mode_reaches_the_engine_args_on_cuda_only():
    """enable_sleep_mode is on for CUDA (else vLLM's sleep frees nothing), off on CPU (vLLM refuses it there)."""
    cfg = _config()
    assert engine_args(cfg, device="cuda", model_dir="/m", max_model_len=64)["enable_sleep_mode"] is True
    assert engine_args(cfg, device="cpu", model_dir="/m", max_model_len=64)["enable_sleep_mode"] is False
    off = _config(enable_sleep_mode=False)
    assert engine_args(off, device="cuda", model_dir="/m", max_model_len=64)["enable_sleep_mode"] is False
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        _config(engine_args={"enable_sleep_mode": True})


def test_vllm_accepts_the_engine_args(tmp_path):
    """vLLM 0.32's AsyncEngineArgs has every field the adapter sets, enable_sleep_mode included."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (run in .venv-vllm: make test-vllm)")
    # a local directory, as the engine passes (vLLM resolves any other name on the hub)
    kwargs = engine_args(_config(), device="cuda", model_dir=str(tmp_path), max_model_len=64)
    args = vllm.AsyncEngineArgs(**kwargs)
    assert args.enable_sleep_mode is True and args.worker_extension_cls.endswith("WeightSyncExtension")


def test_supports_sleep_follows_cuda_and_the_option(monkeypatch):
    """supports_sleep is declared on CUDA with enable_sleep_mode, and refused with the reason otherwise.

    CUDA's presence is faked (torch.cuda.is_available) so the engine can be
    built with device cuda; nothing is started.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on = VLLMRolloutEngine(_config(device="cuda"))
    assert on.features.supports_sleep is True
    off = VLLMRolloutEngine(_config(device="cuda", enable_sleep_mode=False))
    assert off.features.supports_sleep is False
    with pytest.raises(UnsupportedFeatureError, match="enable_sleep_mode is false"):
        asyncio.run(off.sleep(1))
    cpu = VLLMRolloutEngine(_config(device="cpu"))
    with pytest.raises(UnsupportedFeatureError, match="nothing on CPU"):
        asyncio.run(cpu.wake_up())


# ------------------------------------------------------------------ readback of vocabulary shards


def test_shard_rows_follow_vllm_shard_layout():
    """Rows of a shard holding tokens, as vLLM lays them out (pure: shard indices written out by hand)."""
    # vocab 14 padded to 64 over TP 2: rank 0 holds tokens 0..13 then padding; rank 1 padding only
    rank0 = types.SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=14, padded_org_vocab_start_index=0,
                                  padded_org_vocab_end_index=32, added_vocab_start_index=14,
                                  added_vocab_end_index=14)
    rank1 = types.SimpleNamespace(org_vocab_start_index=14, org_vocab_end_index=14, padded_org_vocab_start_index=32,
                                  padded_org_vocab_end_index=64, added_vocab_start_index=14,
                                  added_vocab_end_index=14)
    assert vocab_shard_rows(rank0) == [(slice(0, 14), slice(0, 14))]
    assert vocab_shard_rows(rank1) == []
    # with 4 added (LoRA) tokens: they follow the shard's padded original rows
    added = types.SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=14, padded_org_vocab_start_index=0,
                                  padded_org_vocab_end_index=32, added_vocab_start_index=14,
                                  added_vocab_end_index=18)
    assert vocab_shard_rows(added) == [(slice(0, 14), slice(0, 14)), (slice(32, 36), slice(14, 18))]


def _vllm_vocab_layers(monkeypatch, vocab: int, hidden: int, tp: int, rank: int, full_embed: torch.Tensor,
                       full_head: torch.Tensor) -> torch.nn.Module:
    """One rank's embedding and output projection, built and loaded by vLLM's own layer code.

    vLLM asks its distributed state for the rank and TP size (which needs a
    distributed run): those two answers are stand-ins.
    """
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    monkeypatch.setattr(vpe, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(vpe, "get_tensor_model_parallel_world_size", lambda: tp)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = vpe.VocabParallelEmbedding(vocab, hidden, params_dtype=torch.float32)
    model.lm_head = vpe.ParallelLMHead(vocab, hidden, params_dtype=torch.float32)
    for layer, full in ((model.model.embed_tokens, full_embed), (model.lm_head, full_head)):
        assert (layer.tp_rank, layer.tp_size) == (rank, tp)
        layer.weight_loader(layer.weight, full)
    return model


@pytest.mark.parametrize(("vocab", "tp"), [(14, 2), (14, 4), (100, 2), (64, 2), (200, 4), (32, 1)])
def test_readback_compares_only_real_rows_of_each_shard(monkeypatch, vocab, tp):
    """At any TP size, every rank's real rows match the tensor sent and padding is never compared.

    The layers are vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``
    with their real shard layout and weight loader; only the rank and TP
    size they read from vLLM's distributed state are stand-ins. Before the
    fix, a rank holding padding only (vocab 14 at TP 2) compared its zero
    rows with real ones and failed a good update.
    """
    pytest.importorskip("vllm", reason="vLLM is not installed (run in .venv-vllm: make test-vllm)")
    hidden = 8
    gen = torch.Generator().manual_seed(vocab * 10 + tp)
    sent = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
            "lm_head.weight": torch.randn(vocab, hidden, generator=gen)}
    seen = torch.zeros(vocab, dtype=torch.int64)
    padding_only = 0
    for rank in range(tp):
        model = _vllm_vocab_layers(monkeypatch, vocab, hidden, tp, rank, sent["model.embed_tokens.weight"],
                                   sent["lm_head.weight"])
        report = _readback(model, sent, tied=False, tensor_parallel_size=tp)
        assert report["mismatches"] == [], (rank, report)
        assert report["compared"] + report["padding_only"] == 2 and report["unreadable"] == 0
        padding_only += report["padding_only"]
        shard = model.model.embed_tokens.shard_indices
        for mine, full in vocab_shard_rows(shard):
            seen[full] += 1
            rows = real_vocab_rows(model.model.embed_tokens.weight.detach(), sent["model.embed_tokens.weight"], shard)
            assert rows is not None and torch.equal(rows[0], rows[1])
        # a spoiled real row is caught; a spoiled padding row is not the model's and is not compared
        weight = model.lm_head.weight.data
        pairs = vocab_shard_rows(model.lm_head.shard_indices)
        if pairs:
            row = weight[pairs[0][0].start].clone()
            weight[pairs[0][0].start] += 1.0
            assert _readback(model, sent, tied=False, tensor_parallel_size=tp)["mismatches"] == ["lm_head.weight"]
            weight[pairs[0][0].start] = row
        if pairs and pairs[-1][0].stop < weight.shape[0] or not pairs:
            weight[-1] += 1.0
            assert _readback(model, sent, tied=False, tensor_parallel_size=tp)["mismatches"] == []
    assert torch.equal(seen, torch.ones(vocab, dtype=torch.int64)), "every token is held by exactly one rank"
    # vocab 14 over TP 2: padded to 64, 32 rows a rank, so rank 1 (and ranks 1-3 at TP 4) hold padding only
    if (vocab, tp) == (14, 2):
        assert padding_only == 2
    if (vocab, tp) == (14, 4):
        assert padding_only == 6


# ------------------------------------------------------------------ sleep / wake / pause on the real vLLM


class Loop:
    """An event loop in a thread: the shared engine's AsyncLLM lives on it for the whole module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(loop):
    pytest.importorskip("vllm", reason="vLLM is not installed (run in .venv-vllm: make test-vllm)")
    from asyncflow_core.plugins import get_plugin_manager

    eng = get_plugin_manager().create("rollout_engine", "vllm", tiny_options(eos_token_ids=[]))
    loop.run(eng.start())
    yield eng
    loop.run(eng.shutdown())


@pytest.fixture
def awake(loop, engine):
    """Each test starts and must end with the engine awake, unpaused and with its weights."""
    yield engine

    async def state():
        return engine._sleeping, engine._asleep, engine._paused, engine._weights_missing, \
            await engine._llm.is_sleeping(), await engine._llm.is_paused()

    assert loop.run(state()) == (False, set(), False, False, False, False)


def _request(rid: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=tokens, temperature=1.0))


async def _collect(stream) -> list:
    return [r async for r in stream]


async def _started(engine: VLLMRolloutEngine, n: int, tokens: int = 3) -> None:
    """Until ``n`` requests are in flight and each has sampled ``tokens`` tokens (a condition, polled)."""
    while len(engine._active) < n or min(s.generated for s in engine._active.values()) < tokens:
        await asyncio.sleep(0.005)


def _buckets(version: int, init_seed: int = 3) -> list:
    from asyncflow_plugins.hf.model import build_causal_lm

    net = build_causal_lm(ModelConfig(hf_config=TINY_QWEN2), seed=init_seed)
    items = [(k, v) for k, v in net.state_dict().items() if k != "lm_head.weight"]
    return list(pack_buckets(items, version=version, bucket_bytes=64 << 10))


async def _feed(buckets):
    for b in buckets:
        yield b


def test_sleep_holds_in_flight_requests_instead_of_aborting_them(loop, awake):
    """Requests running when the engine sleeps finish in full after wake_up (vLLM's default mode aborts them)."""
    engine = awake

    async def body():
        task = asyncio.ensure_future(_collect(engine.generate([_request(f"s{i}", 60) for i in range(2)])))
        await _started(engine, 2)
        await engine._sleep(1)
        assert await engine._llm.is_sleeping() and await engine._llm.is_paused()
        assert not task.done() and len(engine._active) == 2
        assert (await engine.health()).detail == "sleeping"
        await engine._wake_up()
        return await task

    results = loop.run(body())
    assert [r.finish_reason for r in results] == [FinishReason.LENGTH] * 2
    assert all(len(r.token_ids) == 60 and len(r.logprobs) == 60 for r in results)


def test_wake_up_does_not_undo_a_held_pause(loop, awake):
    """pause(KEEP) → sleep → wake_up leaves vLLM's scheduler paused; resume lets the held request finish."""
    engine = awake

    async def body():
        task = asyncio.ensure_future(_collect(engine.generate([_request("k", 60)])))
        await _started(engine, 1)
        await engine.pause(PauseMode.KEEP)
        await engine._sleep(1)
        await engine._wake_up()
        # vLLM resumes its scheduler once every memory tag is awake: the kv_cache tag waits for resume
        assert await engine._llm.is_paused(), "wake_up resumed generation under a held pause"
        assert engine._paused and engine._asleep == {"kv_cache"} and not task.done()
        with pytest.raises(ValueError, match="would wait forever"):
            await engine.pause(PauseMode.WAIT)
        await engine.resume()
        assert not await engine._llm.is_paused() and not await engine._llm.is_sleeping()
        return await task

    (result,) = loop.run(body())
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 60


def test_level_2_sleep_refuses_generation_until_a_full_update(loop, awake):
    """After sleep(2) the weights are gone: generate() is refused, across wake_up, until a full update lands."""
    engine = awake

    async def body():
        version = engine.version
        held = asyncio.ensure_future(_collect(engine.generate([_request("h2", 40)])))
        await _started(engine, 1)
        await engine._sleep(2)
        with pytest.raises(EngineError, match=r"sleep\(level=2\)"):
            await _collect(engine.generate([_request("refused", 4)]))
        assert "waiting for a full weight update" in (await engine.health()).detail
        await engine._wake_up()
        # only the weights' memory is back; the scheduler stays held (it would sample from dropped weights)
        assert await engine._llm.is_paused() and engine._asleep == {"kv_cache"}
        with pytest.raises(EngineError, match=r"sleep\(level=2\)"):
            await _collect(engine.generate([_request("refused-again", 4)]))
        # a refused update does not bring the weights back
        with pytest.raises(WeightTransferError):
            await engine.update_weights(version + 1, _feed(_buckets(version + 2)))
        assert engine._weights_missing and await engine._llm.is_paused()
        await engine.update_weights(version + 1, _feed(_buckets(version + 1)))
        assert not engine._weights_missing and engine.last_update["compared"] > 0
        (after,) = await _collect(engine.generate([_request("after", 6)]))
        (before,) = await held
        return version, after, before

    version, after, before = loop.run(body())
    assert set(after.versions) == {version + 1} and len(after.token_ids) == 6
    # the request held through the sleep continued on the new weights only
    assert before.finish_reason is FinishReason.LENGTH and before.versions[-1] == version + 1


def test_sleep_waits_for_an_update_in_progress(loop, awake):
    """sleep() takes the update lock: while an update holds it, vLLM is not put to sleep."""
    engine = awake

    async def body():
        async with engine._update_lock:
            task = asyncio.ensure_future(engine._sleep(1))
            await asyncio.sleep(0)  # let the task run up to the lock
            assert not task.done()
            assert not await engine._llm.is_sleeping() and not engine._sleeping
        await task
        assert engine._sleeping and await engine._llm.is_sleeping()
        await engine._wake_up()

    loop.run(body())


def test_an_update_while_asleep_wakes_only_the_weights(loop, awake):
    """update_weights during a sleep brings back the weights' memory only; wake_up then restores the rest."""
    engine = awake

    async def body():
        version = engine.version
        await engine._sleep(1)
        await engine.update_weights(version + 1, _feed(_buckets(version + 1, init_seed=5)))
        assert engine.version == version + 1 and engine._asleep == {"kv_cache"}
        assert await engine._llm.is_sleeping() and await engine._llm.is_paused()
        await engine._wake_up()
        (res,) = await _collect(engine.generate([_request("w", 5)]))
        return version, res

    version, res = loop.run(body())
    assert set(res.versions) == {version + 1}
