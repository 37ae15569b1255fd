"""Conformance tests for TrainEngine backends."""

from __future__ import annotations

from typing import ClassVar

import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces import TrainEngine
from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_spec.base import BackendSpec, expect_unsupported, forbid, require, run


class TrainEngineSpec(BackendSpec):
    """Subclass and set ``backend``/``options``. Test batches use token ids below ``vocab_size`` (8: valid for any model).

    ``algorithm`` names the algorithm plugin used for train steps (``grpo`` by default).
    """

    kind = PluginKind.TRAIN_ENGINE
    vocab_size: ClassVar[int] = 8
    algorithm: ClassVar[str] = "grpo"
    algorithm_options: ClassVar[dict] = {}

    def batch(self, rows: int = 4, seed: int = 0) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, self.vocab_size, (3,), generator=gen) for _ in range(rows)]
        responses = [torch.randint(0, self.vocab_size, (2 + i % 3,), generator=gen) for i in range(rows)]
        resp = RaggedTensor.from_sequences(responses)
        return Batch(
            {
                C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
                C.RESPONSE_IDS: resp,
                C.REWARD: torch.arange(rows, dtype=torch.float32) % 2,
                C.GROUP_ID: torch.arange(rows, dtype=torch.int64) // 2,
            }
        )

    async def ready(self, make_backend) -> TrainEngine:
        engine = make_backend()
        assert isinstance(engine, TrainEngine), "the factory must return a TrainEngine"
        await engine.setup()
        return engine

    def test_compute_logprobs_aligned_and_pure(self, make_backend):
        """``logprobs`` is ragged, aligned with ``response_ids``, <= 0, and leaves ``version`` unchanged."""

        async def body():
            engine = await self.ready(make_backend)
            try:
                batch = self.batch()
                out = await engine.compute_logprobs(batch)
                lp = out[C.LOGPROBS]
                assert isinstance(lp, RaggedTensor)
                assert torch.equal(lp.offsets, batch[C.RESPONSE_IDS].offsets)
                assert bool((lp.values <= 1e-6).all())
                assert engine.version == 0
                again = await engine.compute_logprobs(batch)
                assert torch.allclose(again[C.LOGPROBS].values, lp.values), "forward must be deterministic"
            finally:
                await engine.shutdown()

        run(body())

    def test_train_step_changes_weights_and_bumps_version(self, make_backend):
        """A train step returns loss and grad_norm, increments ``version`` by one and changes log-probs."""

        async def body():
            engine = await self.ready(make_backend)
            algo = get_plugin_manager().create("algorithm", self.algorithm, self.algorithm_options)
            try:
                batch = self.batch()
                before = await engine.compute_logprobs(batch)
                batch = algo.compute_advantages(before.with_columns(**{C.BEHAVIOR_LOGPROBS: before[C.LOGPROBS]}))
                metrics = await engine.train_step(batch, algo)
                assert {"loss", "grad_norm"} <= set(metrics)
                assert engine.version == 1
                after = await engine.compute_logprobs(batch)
                assert not torch.allclose(after[C.LOGPROBS].values, before[C.LOGPROBS].values)
            finally:
                await engine.shutdown()

        run(body())

    def test_train_step_missing_columns_is_value_error(self, make_backend):
        """A batch without the algorithm's columns raises ValueError and leaves the version at 0."""

        async def body():
            engine = await self.ready(make_backend)
            algo = get_plugin_manager().create("algorithm", self.algorithm, self.algorithm_options)
            try:
                try:
                    await engine.train_step(self.batch().project([C.PROMPT_IDS, C.RESPONSE_IDS]), algo)
                except ValueError:
                    assert engine.version == 0
                    return
                raise AssertionError("train_step accepted a batch without the required columns")
            finally:
                await engine.shutdown()

        run(body())

    def test_export_weights_is_a_whole_verified_version(self, make_backend):
        """Buckets come in index order, carry the engine version, end with ``last`` and pass ``verify``."""

        async def body():
            engine = await self.ready(make_backend)
            try:
                buckets = [b async for b in engine.export_weights(bucket_bytes=1 << 20)]
                assert [b.index for b in buckets] == list(range(len(buckets)))
                assert buckets[-1].last and not any(b.last for b in buckets[:-1])
                for b in buckets:
                    assert b.version == engine.version
                    b.verify()
            finally:
                await engine.shutdown()

        run(body())

    def test_checkpoint_round_trip(self, make_backend, tmp_path):
        """``save`` then ``load`` into a fresh engine restores version and log-probs."""
        require(make_backend().features, "supports_checkpoint")

        async def body():
            engine = await self.ready(make_backend)
            algo = get_plugin_manager().create("algorithm", self.algorithm, self.algorithm_options)
            batch = self.batch()
            lp = await engine.compute_logprobs(batch)
            batch = algo.compute_advantages(lp.with_columns(**{C.BEHAVIOR_LOGPROBS: lp[C.LOGPROBS]}))
            await engine.train_step(batch, algo)
            await engine.save(tmp_path / "ckpt")
            expected = (await engine.compute_logprobs(batch))[C.LOGPROBS].values
            await engine.shutdown()
            fresh = await self.ready(make_backend)
            try:
                await fresh.load(tmp_path / "ckpt")
                assert fresh.version == 1
                got = (await fresh.compute_logprobs(batch))[C.LOGPROBS].values
                assert torch.allclose(got, expected)
            finally:
                await fresh.shutdown()

        run(body())

    def test_values_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_values=False``, ``compute_logprobs(values=True)`` raises UnsupportedFeatureError."""
        forbid(make_backend().features, "supports_values")

        async def body():
            engine = await self.ready(make_backend)
            try:
                await expect_unsupported(engine.compute_logprobs(self.batch(), values=True), "compute_logprobs(values=True)")
            finally:
                await engine.shutdown()

        run(body())

    def test_export_pretrained_writes_a_loadable_checkpoint(self, make_backend, tmp_path):
        """With ``supports_hf_export``, ``export_pretrained`` writes a directory with ``config.json`` and weights."""
        require(make_backend().features, "supports_hf_export")

        async def body():
            engine = await self.ready(make_backend)
            try:
                await engine.export_pretrained(tmp_path / "hf")
            finally:
                await engine.shutdown()
            files = {f.name for f in (tmp_path / "hf").iterdir()}
            assert "config.json" in files, files
            assert any(name.endswith((".safetensors", ".bin")) for name in files), files

        run(body())

    def test_export_pretrained_unsupported_raises_documented_error(self, make_backend, tmp_path):
        """With ``supports_hf_export=False``, ``export_pretrained`` raises UnsupportedFeatureError."""
        forbid(make_backend().features, "supports_hf_export")

        async def body():
            engine = await self.ready(make_backend)
            try:
                await expect_unsupported(engine.export_pretrained(tmp_path / "hf"), "export_pretrained()")
            finally:
                await engine.shutdown()

        run(body())
