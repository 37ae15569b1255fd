"""The LoRA contract end to end between the fsdp trainer and the torch rollout engine (issue 17).

The trainer (``lora`` option, peft on FSDP2, world 1, CPU float32) publishes
version 0 (the whole base) and then adapter-only versions; the torch engine
(``configure_adapter`` with the same :class:`LoraSpec`, merged or live) takes
them through ``update_weights``. Tokens it samples at version 1 carry version
1, and the trainer scores them as the engine did (float32 rounding of the
additions on a log-prob's path); an engine whose adapter sync was skipped
scores them far apart. Tolerance as in adapters/fsdp/tests/test_lora_fsdp.py.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed (pip install -e adapters/fsdp)")
pytest.importorskip("peft", reason="LoRA needs peft (pip install 'asyncflow[lora]')")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import Batch, GenerationRequest, RaggedTensor, SamplingParams  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec  # noqa: E402
from asyncflow_fsdp.testing import TINY_QWEN2, tiny_options  # noqa: E402

LORA = {"rank": 4, "alpha": 8}
VOCAB, LAYERS, RANK = TINY_QWEN2["vocab_size"], TINY_QWEN2["num_hidden_layers"], LORA["rank"]
U32, LAMBDA = torch.finfo(torch.float32).eps / 2, 6.0
FORWARD_TERMS = (LAYERS * (6 * TINY_QWEN2["hidden_size"] + TINY_QWEN2["intermediate_size"] + 7 * RANK)
                 + 2 * TINY_QWEN2["hidden_size"] + VOCAB)


def tol_of(values: torch.Tensor) -> float:
    return 2 * LAMBDA * math.sqrt(FORWARD_TERMS) * U32 * float(values[torch.isfinite(values)].abs().max())


def rollout(mode: str):
    engine = get_plugin_manager().create("rollout_engine", "torch", {
        "model": {"hf_config": dict(TINY_QWEN2), "dtype": "float32"}, "device": "cpu", "init_seed": 0,
        "lora_mode": mode})
    if not callable(getattr(engine, "configure_adapter", None)):
        pytest.skip("the torch engine has no configure_adapter (issue 17's rollout side is not in this tree)")
    engine.configure_adapter(LoraSpec(**LORA))
    return engine


def prompts(rows: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 + i % 3,), generator=gen).tolist() for i in range(rows)]


@pytest.mark.parametrize("mode", ["merged", "live"])
def test_adapter_versions_reach_the_torch_engine_and_a_skipped_sync_shows(mode):
    pm = get_plugin_manager()
    algo = pm.create("algorithm", "grpo", {})
    trainer = pm.create("train_engine", "fsdp", tiny_options(
        model={"hf_config": dict(TINY_QWEN2), "dtype": "float32"}, device="cpu", mixed_precision="float32",
        export_dtype="float32", lora=dict(LORA), lr=5e-2))
    fresh, stale = rollout(mode), rollout(mode)

    async def body():
        await trainer.setup()
        await fresh.start()
        await stale.start()
        try:
            for engine in (fresh, stale):
                await engine.update_weights(0, trainer.export_weights(bucket_bytes=1 << 16))
            ps = prompts()
            batch = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences(ps),
                           C.RESPONSE_IDS: RaggedTensor.from_sequences([[i % VOCAB, (3 * i) % VOCAB] for i in
                                                                        range(len(ps))]),
                           C.REWARD: (torch.arange(len(ps)) % 2).float(), C.GROUP_ID: torch.zeros(len(ps)).long()})
            lp = (await trainer.compute_logprobs(batch))[C.LOGPROBS]
            train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
            await trainer.train_step(train, algo)
            names = [m.name async for b in trainer.export_weights(bucket_bytes=1 << 16) for m in b.metas]
            await fresh.update_weights(1, trainer.export_weights(bucket_bytes=1 << 16))  # stale skips this sync
            sampling = SamplingParams(max_new_tokens=6, seed=3)
            results = [r async for r in fresh.generate([GenerationRequest(f"r{i}", tuple(p), sampling)
                                                        for i, p in enumerate(ps)])]
            results.sort(key=lambda r: int(r.request_id[1:]))
            sampled = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences(ps),
                             C.RESPONSE_IDS: RaggedTensor.from_sequences([list(r.token_ids) for r in results])})
            scored = (await trainer.compute_logprobs(sampled))[C.LOGPROBS].values
            stale_results = [r async for r in stale.generate([GenerationRequest(f"s{i}", tuple(p), sampling)
                                                              for i, p in enumerate(ps)])]
            stale_results.sort(key=lambda r: int(r.request_id[1:]))
            stale_batch = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences(ps), C.RESPONSE_IDS:
                                 RaggedTensor.from_sequences([list(r.token_ids) for r in stale_results])})
            stale_scored = (await trainer.compute_logprobs(stale_batch))[C.LOGPROBS].values
            return names, results, scored, stale_results, stale_scored
        finally:
            await trainer.shutdown()
            await fresh.shutdown()
            await stale.shutdown()

    names, results, scored, stale_results, stale_scored = asyncio.run(asyncio.wait_for(body(), 180))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)  # version 1 is adapter-only
    assert all(int(v) == 1 for r in results for v in r.versions)
    assert all(int(v) == 0 for r in stale_results for v in r.versions)
    engine_lp = torch.cat([torch.as_tensor(list(r.logprobs), dtype=torch.float32) for r in results])
    assert torch.allclose(engine_lp, scored, rtol=0, atol=tol_of(scored)), float((engine_lp - scored).abs().max())
    # the engine that missed version 1 samples from the base: the trainer's log-probs of its tokens are far off
    stale_lp = torch.cat([torch.as_tensor(list(r.logprobs), dtype=torch.float32) for r in stale_results])
    assert float((stale_lp - stale_scored).abs().max()) > 100 * tol_of(stale_scored)
