"""Conformance tests for RolloutEngine backends."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import torch

from asyncflow_core.interfaces import Health, PauseMode, RolloutEngine
from asyncflow_core.plugins import PluginKind
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams
from asyncflow_spec.base import BackendSpec, expect_unsupported, forbid, require, run


class RolloutEngineSpec(BackendSpec):
    """Subclass and set ``backend`` (and ``options``); override ``prompt_token_ids`` if token 1..4 are not valid ids."""

    kind = PluginKind.ROLLOUT_ENGINE
    prompt_token_ids: ClassVar[tuple[int, ...]] = (1, 2, 3)
    max_new_tokens: ClassVar[int] = 8

    def request(self, rid: str, **sampling) -> GenerationRequest:
        params = {"max_new_tokens": self.max_new_tokens, **sampling}
        return GenerationRequest(rid, self.prompt_token_ids, SamplingParams(**params))

    async def started(self, make_backend) -> RolloutEngine:
        engine = make_backend()
        assert isinstance(engine, RolloutEngine), "the factory must return a RolloutEngine"
        await engine.start()
        return engine

    def test_generate_yields_one_aligned_result_per_request(self, make_backend):
        """Every request yields exactly one result; token ids, log-probs and versions are aligned.

        Fix: make ``generate`` yield one GenerationResult per request, with
        equal-length ``token_ids``/``logprobs``/``versions``.
        """

        async def body():
            engine = await self.started(make_backend)
            try:
                reqs = [self.request(f"r{i}") for i in range(5)]
                results = [r async for r in engine.generate(reqs)]
                assert sorted(r.request_id for r in results) == sorted(q.request_id for q in reqs)
                for r in results:
                    assert len(r.token_ids) == len(r.logprobs) == len(r.versions)
                    assert 1 <= len(r.token_ids) <= self.max_new_tokens
                    assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                    assert all(lp <= 1e-6 for lp in _values(r.logprobs)), "log-probs must be <= 0"
                    assert set(_values(r.versions)) == {engine.version}
                    assert r.prompt_token_ids == self.prompt_token_ids
            finally:
                await engine.shutdown()

        run(body())

    def test_length_finish_respects_max_new_tokens(self, make_backend):
        """With no stop tokens, a result ends with reason ``length`` at exactly ``max_new_tokens``."""

        async def body():
            engine = await self.started(make_backend)
            try:
                (res,) = [r async for r in engine.generate([self.request("len", max_new_tokens=3)])]
                assert res.finish_reason is FinishReason.LENGTH
                assert len(res.token_ids) == 3
            finally:
                await engine.shutdown()

        run(body())

    def test_duplicate_request_ids_are_refused(self, make_backend):
        """Two in-flight requests with one id must raise ValueError before generating anything."""

        async def body():
            engine = await self.started(make_backend)
            try:
                try:
                    [r async for r in engine.generate([self.request("dup"), self.request("dup")])]
                except ValueError:
                    return
                raise AssertionError("duplicate request ids were accepted")
            finally:
                await engine.shutdown()

        run(body())

    def test_abort_returns_partial_results_through_generate(self, make_backend, registration):
        """Aborted requests come out of ``generate`` with finish reason ``abort`` and their partial tokens.

        Fix: mark aborted requests, finish them at the next step, and yield
        their results (tokens so far) from the iterator that owns them.
        """
        require(make_backend().features, "supports_abort")

        async def body():
            engine = await self.started(make_backend)
            try:
                reqs = [self.request(f"a{i}", max_new_tokens=10_000) for i in range(3)]
                stream = engine.generate(reqs)
                first_step = asyncio.ensure_future(_collect(stream))
                await asyncio.sleep(0)
                aborted = await engine.abort([reqs[0].request_id, "no-such-request"])
                assert aborted == [reqs[0].request_id], "abort must return only the ids it aborted"
                await engine.abort(None)
                results = await first_step
                assert sorted(r.request_id for r in results) == sorted(r.request_id for r in reqs)
                assert all(r.finish_reason is FinishReason.ABORT for r in results)
                for r in results:
                    assert len(r.token_ids) == len(r.logprobs) == len(r.versions) < 10_000
            finally:
                await engine.shutdown()

        run(body())

    def test_abort_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_abort=False``, ``abort`` raises UnsupportedFeatureError."""
        engine = make_backend()
        forbid(engine.features, "supports_abort")
        run(expect_unsupported(engine.abort(None), "abort()"))

    def test_pause_keep_holds_and_resume_continues(self, make_backend):
        """``pause(KEEP)`` holds in-flight requests without sampling; ``resume`` finishes them normally."""
        require(make_backend().features, "supports_pause_keep")

        async def body():
            engine = await self.started(make_backend)
            try:
                reqs = [self.request(f"k{i}", max_new_tokens=50) for i in range(2)]
                task = asyncio.ensure_future(_collect(engine.generate(reqs)))
                await asyncio.sleep(0)
                await engine.pause(PauseMode.KEEP)
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not task.done(), "requests finished while the engine was paused with KEEP"
                await engine.resume()
                results = await task
                assert {r.finish_reason for r in results} <= {FinishReason.STOP, FinishReason.LENGTH}
            finally:
                await engine.shutdown()

        run(body())

    def test_pause_keep_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_pause_keep=False``, ``pause(KEEP)`` raises UnsupportedFeatureError."""
        forbid(make_backend().features, "supports_pause_keep")

        async def body():
            engine = await self.started(make_backend)
            try:
                await expect_unsupported(engine.pause(PauseMode.KEEP), "pause(KEEP)")
            finally:
                await engine.shutdown()

        run(body())

    def test_sleep_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_sleep=False``, ``sleep`` and ``wake_up`` raise UnsupportedFeatureError."""
        forbid(make_backend().features, "supports_sleep")

        async def body():
            engine = await self.started(make_backend)
            try:
                await expect_unsupported(engine.sleep(1), "sleep()")
                await expect_unsupported(engine.wake_up(), "wake_up()")
            finally:
                await engine.shutdown()

        run(body())

    def test_health_and_double_shutdown(self, make_backend):
        """``health`` answers a Health model; ``shutdown`` twice is safe."""

        async def body():
            engine = await self.started(make_backend)
            health = await engine.health()
            assert isinstance(health, Health) and health.ok
            await engine.shutdown()
            await engine.shutdown()

        run(body())


def _values(seq) -> list:
    """The Python numbers of a result field: the contract allows a sequence or a 1-D tensor."""
    if isinstance(seq, torch.Tensor):
        assert seq.dim() == 1, f"a result tensor must be 1-D, got shape {tuple(seq.shape)}"
        return seq.tolist()
    return list(seq)


async def _collect(stream):
    return [r async for r in stream]
