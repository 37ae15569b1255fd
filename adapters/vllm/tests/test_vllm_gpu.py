"""The ``vllm`` engine's CUDA paths, run for real on CUDA (``make test-gpu``; skipped without CUDA).

Written against vLLM 0.32.0 and torch 2.13.0 by reading their source; these
tests have not run yet (no GPU was available where they were written), so a
failure here may be the test's as well as the adapter's. What each needs:

- NCCL weight updates: one GPU more than the tensor-parallel size (rank 0 of
  the weight group needs a GPU no vLLM worker uses), so 2 GPUs at TP 1 and
  3 at TP 2;
- gloo through the CPU into CUDA workers, sleep and wake: one GPU.

The model is a small random Qwen2 in bf16 whose vocabulary (14) is far below
vLLM's padded vocabulary (64): at TP 2 the second rank's vocabulary shards
hold padding only, the case readback used to get wrong.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tests run in .venv-vllm: make test-vllm)")

from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import ConfigError, EngineError  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, pack_buckets  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402
from asyncflow_vllm import engine as engine_module  # noqa: E402
from asyncflow_vllm import weight_group  # noqa: E402

#: Two attention heads and two KV heads, so TP 2 divides them; head dimension 64; lm_head not tied, so both
#: vocabulary-sharded parameters are read back
GPU_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 14,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "eos_token_id": 13,
}


#: For the deadline test: ~270M parameters (~540 MB in bf16), far more than NCCL can buffer between two GPUs
#: (a few MiB per channel), so a broadcast nobody receives cannot complete on the sender's side
GPU_QWEN2_LARGE: dict[str, Any] = {
    **GPU_QWEN2,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs(gpus: int) -> None:
    if _gpus() < gpus:
        pytest.skip(f"needs {gpus} GPUs (this machine has {_gpus()})")


def _options(tp: int = 1, hf_config: dict[str, Any] = GPU_QWEN2, **overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "model": {"hf_config": dict(hf_config), "dtype": "bfloat16"},
        "device": "cuda",
        "tensor_parallel_size": tp,
        "gpu_memory_utilization": 0.2,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "eos_token_ids": [],
        "weight_sync_timeout_s": 60,
    }
    options.update(overrides)
    return options


def _buckets(version: int, seed: int, hf_config: dict[str, Any] = GPU_QWEN2, bucket_bytes: int = 128 << 10) -> list:
    net = build_causal_lm(ModelConfig(hf_config=hf_config, dtype="bfloat16"), seed=seed)
    return list(pack_buckets(net.state_dict().items(), version=version, bucket_bytes=bucket_bytes))


async def _feed(buckets):
    for b in buckets:
        yield b


async def _generate(eng, rid: str, tokens: int = 8) -> Any:
    (res,) = [r async for r in eng.generate([GenerationRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=tokens))])]
    return res


def _run(body) -> Any:
    return asyncio.run(asyncio.wait_for(body(), 900))


async def _started(options: dict[str, Any]):
    eng = get_plugin_manager().create("rollout_engine", "vllm", options)
    await eng.start()
    return eng


async def _digest(eng) -> list[str]:
    return await eng._llm.collective_rpc("asyncflow_param_digest")


def _free(device: int = 0) -> int:
    return torch.cuda.mem_get_info(device)[0]


@pytest.mark.gpu
class TestVLLMOnCUDA:
    """Every GPU-only path of the adapter, for real."""

    def _update_and_check(self, tp: int, backend: str) -> None:
        async def body():
            eng = await _started(_options(tp, weight_sync_backend=backend))
            try:
                sync = eng.weight_sync
                infos = await eng._llm.collective_rpc("asyncflow_device")
                assert len(infos) == tp and all(i["device"].startswith("cuda") for i in infos)
                if backend == "nccl":
                    assert sync["backend"] == "nccl"
                    mine = weight_group.cuda_uuids()[torch.device(sync["device"]).index]
                    assert mine not in {i["uuid"] for i in infos}, "rank 0 shares a GPU with a worker"
                else:
                    assert sync == {"backend": "gloo", "device": "cpu"}
                before = await _digest(eng)
                await eng.update_weights(1, _feed(_buckets(1, seed=7)))
                assert eng.version == 1 and await _digest(eng) != before
                report = eng.last_update
                assert report["compared"] > 0, report
                if tp == 2:
                    # vocab 14 padded to 64 over 2 ranks: rank 1 holds padding only in embed_tokens and lm_head
                    assert report["padding_only"] == 2, report
                if backend == "nccl":
                    timeout = eng._group.group.options._timeout
                    assert timeout == datetime.timedelta(seconds=60 + weight_group.WATCHDOG_MARGIN_S)
                res = await _generate(eng, "after")
                assert set(res.versions) == {1} and res.finish_reason is FinishReason.LENGTH
            finally:
                await eng.shutdown()

        _run(body)

    def test_nccl_update_at_tp_1(self):
        """NCCL from a GPU no worker uses into one worker; readback compares the parameters."""
        _needs(2)
        self._update_and_check(1, "nccl")

    def test_nccl_update_at_tp_2_with_a_padded_vocabulary(self):
        """TP 2 with a vocabulary smaller than its padding: the all-padding shards are not compared with real rows."""
        _needs(3)
        self._update_and_check(2, "nccl")

    def test_gloo_through_the_cpu_into_cuda_workers(self):
        """With no GPU to spare (or gloo asked for), buckets go through the CPU into the CUDA workers."""
        _needs(1)
        self._update_and_check(1, "gloo")

    def test_a_workers_gpu_named_for_rank_0_is_refused(self):
        """weight_sync_device naming worker 0's GPU is a ConfigError at start (NCCL would refuse it later)."""
        _needs(1)

        async def body():
            eng = get_plugin_manager().create("rollout_engine", "vllm", _options(1, weight_sync_device="cuda:0"))
            with pytest.raises(ConfigError, match="NCCL refuses two ranks"):
                await eng.start()
            assert not (await eng.health()).ok

        _run(body)

    def test_sleep_level_1_frees_memory_holds_requests_and_restores_the_weights(self):
        """sleep(1) frees most of what vLLM took, keeps in-flight requests, and wake_up restores the same weights."""
        _needs(1)

        async def body():
            free_before = _free()
            eng = await _started(_options(1))
            try:
                assert eng.features.supports_sleep
                used = free_before - _free()
                assert used > 0
                digest = await _digest(eng)
                running = asyncio.ensure_future(_generate(eng, "held", tokens=300))
                while not eng._active or min(s.generated for s in eng._active.values()) < 3:
                    await asyncio.sleep(0.005)
                awake = _free()
                await eng.sleep(1)
                asleep = _free()
                assert asleep - awake > used // 2, (used, awake, asleep)
                assert not running.done()
                await eng.wake_up()
                assert asleep - _free() > used // 2
                assert await _digest(eng) == digest
                held = await running
                assert held.finish_reason is FinishReason.LENGTH and len(held.token_ids) == 300
            finally:
                await eng.shutdown()

        _run(body)

    def test_sleep_level_2_refuses_generation_until_a_full_update(self):
        """After sleep(2) the weights are gone: generate() is refused until update_weights loads a full version."""
        _needs(1)

        async def body():
            eng = await _started(_options(1))
            try:
                awake = _free()
                await eng.sleep(2)
                assert _free() > awake
                with pytest.raises(EngineError, match=r"sleep\(level=2\)"):
                    await _generate(eng, "refused")
                await eng.wake_up()
                with pytest.raises(EngineError, match=r"sleep\(level=2\)"):
                    await _generate(eng, "still-refused")
                await eng.update_weights(1, _feed(_buckets(1, seed=11)))
                assert eng.last_update["compared"] > 0
                res = await _generate(eng, "after")
                assert set(res.versions) == {1}
                assert not await eng._llm.is_sleeping()
            finally:
                await eng.shutdown()

        _run(body)

    def test_an_nccl_transfer_nobody_receives_fails_by_its_deadline_and_the_engine_serves_on(self):
        """Workers that never post their receives: the update fails at the deadline, version and weights unchanged.

        The workers' side of the update is replaced by a report that they
        loaded nothing (as a worker stuck elsewhere would leave it): the
        broadcast is real NCCL, waiting for receivers that never come, and
        larger than NCCL can buffer. The process must survive (torch's
        watchdog is never handed a failed operation), and the next update
        sets the group up again.
        """
        _needs(2)
        timeout_s = 20.0

        def buckets(version: int, seed: int) -> list:
            return _buckets(version, seed, GPU_QWEN2_LARGE, bucket_bytes=64 << 20)

        async def body():
            eng = await _started(_options(1, GPU_QWEN2_LARGE, weight_sync_backend="nccl",
                                          weight_sync_timeout_s=timeout_s))
            try:
                await eng.update_weights(1, _feed(buckets(1, seed=7)))
                digest = await _digest(eng)

                async def nobody_receives(llm, version, metas, aliases, deadline):
                    return [{"rank": 1, "tensors": 0, "touched": False}]

                eng._load_rpc = nobody_receives
                began = time.monotonic()
                with pytest.raises(EngineError, match="did not reach vLLM's workers.*weight_sync_timeout_s"):
                    await eng.update_weights(2, _feed(buckets(2, seed=8)))
                took = time.monotonic() - began
                assert took < timeout_s + engine_module._REPORT_GRACE_S, took
                assert eng.version == 1 and eng._group is None and (await eng.health()).ok
                assert await _digest(eng) == digest
                assert set((await _generate(eng, "still-v1")).versions) == {1}
                del eng._load_rpc  # the real workers again: the group is set up anew
                await eng.update_weights(2, _feed(buckets(2, seed=8)))
                assert set((await _generate(eng, "v2")).versions) == {2}
            finally:
                await eng.shutdown()

        _run(body)
