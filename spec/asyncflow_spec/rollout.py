"""Conformance tests for RolloutEngine backends."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import ClassVar

import pytest
import torch

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import Health, PauseMode, RolloutEngine
from asyncflow_core.plugins import PluginKind
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, WeightBucket, pack_buckets
from asyncflow_spec.base import BackendSpec, expect_unsupported, forbid, require, run


class RolloutEngineSpec(BackendSpec):
    """Subclass and set ``backend`` (and ``options``); override ``prompt_token_ids`` if token 1..4 are not valid ids.

    Override :meth:`weights` to run the weight-update tests: it returns a
    complete set of named tensors the engine accepts (e.g. the state dict of
    the same architecture with other values); without it they are skipped.
    """

    kind = PluginKind.ROLLOUT_ENGINE
    prompt_token_ids: ClassVar[tuple[int, ...]] = (1, 2, 3)
    max_new_tokens: ClassVar[int] = 8
    #: length of the requests held across ``pause(KEEP)``: long enough that they are still decoding when the
    #: pause lands (a round trip after the submit for an engine behind an RPC), short enough to finish in seconds
    held_new_tokens: ClassVar[int] = 2_000

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Every tensor of an update the engine accepts (names, shapes and dtypes of its model); None skips."""
        return None

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
                # engines cap the length at their context window; see held_new_tokens
                reqs = [self.request(f"k{i}", max_new_tokens=self.held_new_tokens) for i in range(2)]
                task = asyncio.ensure_future(_collect(engine.generate(reqs)))
                await asyncio.sleep(0)
                await engine.pause(PauseMode.KEEP)
                for _ in range(5):
                    await asyncio.sleep(0)
                await asyncio.sleep(0.05)  # and over wall time, for engines that sample off the event loop
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

    def test_pause_abort_ends_in_flight_and_holds_new_until_resume(self, make_backend):
        """``pause(ABORT)`` ends in-flight requests with reason ``abort``; a request sent while paused waits for ``resume``.

        Fix: abort what is running, return once quiescent, and admit nothing
        new until ``resume()``.
        """
        require(make_backend().features, "supports_pause_abort")

        async def body():
            engine = await self.started(make_backend)
            try:
                running = asyncio.ensure_future(
                    _collect(engine.generate([self.request(f"pa{i}", max_new_tokens=10_000) for i in range(2)]))
                )
                await asyncio.sleep(0)
                await engine.pause(PauseMode.ABORT)
                results = await asyncio.wait_for(running, 60)
                assert {r.finish_reason for r in results} == {FinishReason.ABORT}
                held = asyncio.ensure_future(_collect(engine.generate([self.request("held", max_new_tokens=3)])))
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not held.done(), "a request sent while paused finished before resume()"
                await engine.resume()
                (res,) = await asyncio.wait_for(held, 60)
                assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            finally:
                await engine.shutdown()

        run(body())

    def test_resume_prefix_is_continued_not_restarted(self, make_backend):
        """A request carrying a prefix from an aborted attempt returns that prefix first, then new tokens.

        Fix: feed prompt + prefix as context, generate at most
        ``max_new_tokens - len(prefix)`` more, and return prefix + new tokens
        (with the prefix's log-probs and versions unchanged).
        """
        require(make_backend().features, "supports_resume_prefix")

        async def body():
            engine = await self.started(make_backend)
            try:
                (first,) = [r async for r in engine.generate([self.request("pre", max_new_tokens=2)])]
                if first.finish_reason is not FinishReason.LENGTH:
                    pytest.skip("the first attempt stopped early; no prefix to continue")
                prefix = tuple(int(t) for t in _values(first.token_ids))
                resumed = dataclasses.replace(
                    self.request("cont", max_new_tokens=6),
                    prefix_token_ids=prefix,
                    prefix_logprobs=tuple(float(x) for x in _values(first.logprobs)),
                    prefix_versions=tuple(int(v) for v in _values(first.versions)),
                )
                (res,) = [r async for r in engine.generate([resumed])]
                tokens = [int(t) for t in _values(res.token_ids)]
                assert tokens[: len(prefix)] == list(prefix), "the resumed prefix must come back first"
                assert [float(x) for x in _values(res.logprobs)][: len(prefix)] == pytest.approx(
                    [float(x) for x in _values(first.logprobs)]
                )
                assert len(prefix) <= len(tokens) <= 6
                assert len(res.token_ids) == len(res.logprobs) == len(res.versions)
            finally:
                await engine.shutdown()

        run(body())

    def _update(self, version: int) -> list[WeightBucket]:
        tensors = self.weights()
        if tensors is None:
            pytest.skip("weights() is not overridden: the weight-update tests need a set of tensors the engine accepts")
        # small buckets, so an update has several and the bad-bucket test can spoil one in the middle
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return list(pack_buckets(tensors.items(), version=version, bucket_bytes=max(1, total // 3)))

    def test_update_weights_moves_every_new_token_to_the_new_version(self, make_backend):
        """After ``update_weights(v)``, ``version`` is v and every token sampled afterwards carries v.

        Fix: apply all buckets, then set the version at a step boundary (the
        safe point), so no token mixes versions.
        """

        async def body():
            engine = await self.started(make_backend)
            try:
                new = engine.version + 1
                await engine.update_weights(new, _feed(self._update(new)))
                assert engine.version == new
                results = [r async for r in engine.generate([self.request(f"u{i}") for i in range(3)])]
                for r in results:
                    assert set(_values(r.versions)) == {new}, "tokens sampled after an update must carry its version"
            finally:
                await engine.shutdown()

        run(body())

    def test_bad_bucket_is_refused_and_keeps_the_old_version(self, make_backend):
        """A corrupted bucket raises WeightTransferError, and the old version stays in force.

        Fix: call ``bucket.verify()`` on every bucket and check names and
        shapes before touching a parameter.
        """

        async def body():
            engine = await self.started(make_backend)
            try:
                old = engine.version
                buckets = self._update(old + 1)
                bad = buckets[len(buckets) // 2]
                spoiled = bad.buffer.clone()
                spoiled[0] ^= 0xFF
                buckets[len(buckets) // 2] = dataclasses.replace(bad, buffer=spoiled)
                with pytest.raises(WeightTransferError):
                    await engine.update_weights(old + 1, _feed(buckets))
                assert engine.version == old, "a refused update must leave the version unchanged"
                (res,) = [r async for r in engine.generate([self.request("after-bad")])]
                assert set(_values(res.versions)) == {old}
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


async def _feed(buckets):
    for bucket in buckets:
        yield bucket


async def _collect(stream):
    return [r async for r in stream]
