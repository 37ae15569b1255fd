"""Conformance tests for RolloutEngine backends.

The suite proves behaviour, not tags: log-probs are compared with a
reference computed without the engine (:mod:`asyncflow_spec.reference`),
weight updates must change those log-probs to the new weights, and every
declared feature is exercised. How a spec class supplies what a test needs:

- an engine that serves a Hugging Face model declares a ``model`` option
  (``asyncflow_core.config.models.ModelConfig``, the run's ``model``
  section); when ``options`` leave it unset the suite passes its own tiny
  Llama (``{"path": <dir>, "dtype": "float32"}``, :func:`spec_model`) and
  scores tokens with the same weights in float64;
- an engine with its own policy overrides :meth:`RolloutEngineSpec.reference_logprobs`
  (and :meth:`RolloutEngineSpec.weights` for the weight-update tests);
- with neither, the tests that need an oracle skip and say why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine
from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightBucket,
    pack_buckets,
)
from asyncflow_spec.base import BackendSpec, expect_unsupported, forbid, require, run
from asyncflow_spec.reference import (
    TINY_LLAMA,
    HFReference,
    Reference,
    ScorerReference,
    compare,
    save_tiny_model,
)

#: Sampling settings of the log-prob convention test: plain, temperature only, and each truncation with it.
CONVENTION_CASES: dict[str, dict[str, Any]] = {
    "plain": {"temperature": 1.0},
    "temperature": {"temperature": 0.6},
    "top_k": {"temperature": 1.3, "top_k": 5},
    "top_p": {"temperature": 0.8, "top_p": 0.7},
    "all": {"temperature": 0.9, "top_k": 12, "top_p": 0.85},
}


class RolloutEngineSpec(BackendSpec):
    """Subclass and set ``backend`` (and ``options``); see the module docstring for what the oracle tests need.

    Class attributes a subclass may set:

    - ``prompt_token_ids``: the prompt of most requests (ids 1, 2, 3 by default).
    - ``vocab_size`` / ``context_limit``: for an engine without a Hugging Face
      model (a Hugging Face model's config gives both): the stop-token and
      bad-request tests need the vocabulary, the context test the limit.
    - ``paired_trainer`` / ``paired_trainer_options``: the train engine whose
      exported weights the engine must load (default: ``fsdp`` for an engine
      that serves a Hugging Face model).
    - ``spec_model_config``: the architecture of the suite's tiny model.
    """

    kind = PluginKind.ROLLOUT_ENGINE
    prompt_token_ids: ClassVar[tuple[int, ...]] = (1, 2, 3)
    max_new_tokens: ClassVar[int] = 8
    #: length of the requests held across ``pause(KEEP)``: long enough that they are still decoding when the
    #: pause lands (a round trip after the submit for an engine behind an RPC), short enough to finish in seconds
    held_new_tokens: ClassVar[int] = 2_000
    #: the option through which the engine takes the model it serves (a ModelConfig mapping)
    model_option: ClassVar[str] = "model"
    spec_model_config: ClassVar[dict[str, Any]] = TINY_LLAMA
    vocab_size: ClassVar[int | None] = None
    context_limit: ClassVar[int | None] = None
    paired_trainer: ClassVar[str | None] = None
    paired_trainer_options: ClassVar[dict[str, Any]] = {}
    #: deadline of each test's body (a hung engine fails, never hangs the suite)
    timeout_s: ClassVar[float] = 120.0

    # -- hooks a spec class overrides -----------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Every tensor of an update the engine accepts (names, shapes and dtypes of its model); None: the suite's.

        For an engine serving a Hugging Face model the suite makes its own
        (the same architecture with new random values, in the trainers'
        export format); override it only to push something else.
        """
        return None

    def reference_logprobs(self, prompt: tuple[int, ...], completion: tuple[int, ...], sampling: SamplingParams,
                           *, weights: Mapping[str, torch.Tensor] | None) -> Sequence[float] | torch.Tensor | None:
        """The log-prob of each ``completion`` token under ``sampling``, for an engine without a Hugging Face model.

        ``weights`` is None for the engine's initial weights, else the tensors
        of the last update the suite pushed. Score in float32 or better under
        the convention of ``SamplingParams`` (``sampling_logprobs``). Return
        None (the default) when the spec class has no scorer.
        """
        return None

    # -- fixtures -------------------------------------------------------------------------------------

    @classmethod
    def takes_model(cls) -> bool:
        """Whether the backend's options declare ``model_option`` (it serves a Hugging Face model)."""
        record = get_plugin_manager().lookup(cls.kind, cls.backend).record
        return cls.model_option in getattr(record.config_model, "model_fields", {})

    @pytest.fixture(scope="class")
    @classmethod
    def spec_model(cls, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any] | None:
        """The suite's tiny model as a ``ModelConfig`` mapping, for an engine taking a model the options leave unset."""
        if not cls.backend or cls.model_option in cls.options or not cls.takes_model():
            return None
        directory = save_tiny_model(tmp_path_factory.mktemp("spec-model"), prompt=cls.prompt_token_ids,
                                    hf_config=cls.spec_model_config)
        return {"path": str(directory), "dtype": "float32"}

    @pytest.fixture
    def backend_options(self, spec_model: dict[str, Any] | None) -> dict[str, Any]:
        options = dict(self.options)
        if spec_model is not None:
            options[self.model_option] = spec_model
        return options

    def reference(self, make_backend: Any) -> Reference | None:
        """The oracle for the engine ``make_backend`` builds: its Hugging Face model, else the spec's scorer."""
        options = getattr(make_backend, "options", None)
        options = self.options if not isinstance(options, dict) else options
        model = options.get(self.model_option)
        if isinstance(model, BaseModel):
            model = model.model_dump()
        if isinstance(model, Mapping) and (model.get("path") or model.get("hf_config")) and self.takes_model():
            return HFReference(model)
        if type(self).reference_logprobs is not RolloutEngineSpec.reference_logprobs:
            return ScorerReference(self.reference_logprobs, vocab_size=self.vocab_size,
                                   context_limit=self.context_limit)
        return None

    def needs_reference(self, make_backend: Any) -> Reference:
        ref = self.reference(make_backend)
        if ref is None:
            pytest.skip("no oracle: the engine serves no Hugging Face model (no `model` option) and the spec class "
                        "does not override reference_logprobs()")
        return ref

    # -- helpers --------------------------------------------------------------------------------------

    def request(self, rid: str, **sampling: Any) -> GenerationRequest:
        params = {"max_new_tokens": self.max_new_tokens, **sampling}
        return GenerationRequest(rid, self.prompt_token_ids, SamplingParams(**params))

    async def started(self, make_backend: Any) -> RolloutEngine:
        engine = make_backend()
        assert isinstance(engine, RolloutEngine), "the factory must return a RolloutEngine"
        await engine.start()
        return engine

    def run(self, coro: Any) -> Any:
        return run(coro, timeout=self.timeout_s)

    def known_vocab(self, make_backend: Any) -> int:
        ref = self.reference(make_backend)
        vocab = self.vocab_size or (ref.vocab_size if ref is not None else None)
        if vocab is None:
            pytest.skip("the vocabulary size is unknown: set vocab_size on the spec class")
        return vocab

    def update_tensors(self, ref: Reference | None, seed: int) -> dict[str, torch.Tensor]:
        """``weights()`` when overridden, else new weights the reference makes; skips when neither exists."""
        tensors = self.weights()
        if tensors is None and ref is not None:
            tensors = ref.fresh_weights(seed)
        if tensors is None:
            pytest.skip("no weights to push: override weights() (the engine serves no Hugging Face model the suite "
                        "could make weights for)")
        return dict(tensors)

    def other_tensors(self, ref: Reference | None, seed: int) -> dict[str, torch.Tensor]:
        """A second set of weights, different from :meth:`update_tensors` when the reference can make one."""
        made = ref.fresh_weights(seed) if ref is not None else None
        return dict(made) if made is not None else self.update_tensors(ref, seed)

    async def push(self, engine: RolloutEngine, tensors: Mapping[str, torch.Tensor], ref: Reference | None = None,
                   **kwargs: Any) -> int:
        """Update ``engine`` to its next version with ``tensors`` (and score with them from now on)."""
        version = engine.version + 1
        await engine.update_weights(version, _feed(_buckets(tensors, version)), **kwargs)
        if ref is not None:
            ref.load(tensors)
        return version

    async def known_weights(self, engine: RolloutEngine, ref: Reference) -> None:
        """Make sure the reference holds the weights the engine samples with (push the suite's when it cannot know)."""
        if not ref.knows_initial_weights:
            await self.push(engine, self.update_tensors(ref, seed=11), ref)

    def known_limit(self, make_backend: Any) -> int | None | str:
        """The context limit: a number, None (none: the policy is the spec's scorer), or ``"unknown"``."""
        if self.context_limit is not None:
            return self.context_limit
        ref = self.reference(make_backend)
        return "unknown" if ref is None else ref.context_limit

    def check_result(self, req: GenerationRequest, res: GenerationResult, limit: int | None | str = "unknown") -> None:
        """What every result owes its request: alignment, and an end only at a stop id, the length or the context.

        ``limit`` is :meth:`known_limit`: with ``"unknown"`` a ``length``
        result may be shorter than ``max_new_tokens`` (an unknown context
        limit may have capped it).
        """
        assert res.request_id == req.request_id
        assert len(res.token_ids) == len(res.logprobs) == len(res.versions)
        tokens = [int(t) for t in _values(res.token_ids)]
        stops = set(req.sampling.stop_token_ids)
        generated = tokens[len(req.prefix_token_ids):]
        if res.finish_reason is FinishReason.STOP:
            assert generated and generated[-1] in stops, (
                f"{res.request_id}: finish reason stop, but the last token {generated[-1:]} is not one of the "
                f"request's stop_token_ids {sorted(stops)}: only the request's stop ids end a completion early "
                "(the model's EOS counts only when the request lists it)"
            )
            assert not stops & set(generated[:-1]), f"{res.request_id}: generation went on past a stop id"
        elif res.finish_reason is FinishReason.LENGTH:
            assert not stops & set(generated), f"{res.request_id}: a stop id was sampled but the reason is length"
            full = len(tokens) == req.sampling.max_new_tokens
            capped = isinstance(limit, int) and len(req.prompt_token_ids) + len(tokens) >= limit
            assert full or capped or (limit == "unknown" and len(tokens) < req.sampling.max_new_tokens), (
                f"{res.request_id}: reason length after {len(tokens)} of max_new_tokens="
                f"{req.sampling.max_new_tokens}, within the context limit {limit}"
            )

    def assert_matches(self, ref: Reference, results: Sequence[GenerationResult], sampling: SamplingParams,
                       what: str, **kwargs: Any) -> None:
        found = compare(ref, results, sampling, **kwargs)
        assert found.compared, f"{what}: no token could be compared with the reference"
        assert found.worst <= 1.0, (
            f"{what}: returned log-probs differ from {ref.what} by {found.worst:.1f}x the tolerance at "
            f"{found.where}. Return log_softmax(logits / temperature) after top-k and top-p, renormalised "
            "(asyncflow_core.types.sampling.sampling_logprobs), computed with the weights the version says"
        )

    # -- the core contract ----------------------------------------------------------------------------

    def test_generate_yields_one_aligned_result_per_request(self, make_backend):
        """Every request yields exactly one result; token ids, log-probs and versions are aligned.

        Fix: make ``generate`` yield one GenerationResult per request, with
        equal-length ``token_ids``/``logprobs``/``versions``.
        """
        limit = self.known_limit(make_backend)

        async def body():
            engine = await self.started(make_backend)
            try:
                reqs = [self.request(f"r{i}") for i in range(5)]
                results = [r async for r in engine.generate(reqs)]
                assert sorted(r.request_id for r in results) == sorted(q.request_id for q in reqs)
                by_id = {q.request_id: q for q in reqs}
                for r in results:
                    self.check_result(by_id[r.request_id], r, limit)
                    assert 1 <= len(r.token_ids) <= self.max_new_tokens
                    assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                    assert all(lp <= 1e-6 for lp in _values(r.logprobs)), "log-probs must be <= 0"
                    assert set(_values(r.versions)) == {engine.version}
                    assert r.prompt_token_ids == self.prompt_token_ids
            finally:
                await engine.shutdown()

        self.run(body())

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

        self.run(body())

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

        self.run(body())

    def test_stop_ids_and_length_are_all_that_end_a_completion(self, make_backend):
        """A request's ``stop_token_ids`` end it (the stop token included); without them it runs to ``max_new_tokens``.

        The model's own EOS ends a completion only when the request lists it
        in ``stop_token_ids`` (the runtime does so for the task's end token):
        the suite's model makes its EOS the most likely first token, so an
        engine that stops on it unasked fails here. Fix: stop on exactly the
        request's stop ids (vLLM: ``ignore_eos=True`` with ``stop_token_ids``),
        include the stop token, and end with ``length`` at ``max_new_tokens``.
        """
        vocab = self.known_vocab(make_backend)
        limit = self.known_limit(make_backend)

        async def body():
            engine = await self.started(make_backend)
            try:
                everything = self.request("stop-all", stop_token_ids=tuple(range(vocab)))
                (res,) = [r async for r in engine.generate([everything])]
                assert res.finish_reason is FinishReason.STOP and len(res.token_ids) == 1, (
                    f"with every token a stop id the first token must end the completion (reason stop, one token); "
                    f"got reason {res.finish_reason.value} after {len(res.token_ids)} tokens"
                )
                unasked = [self.request(f"no-stop{i}", temperature=0.3, max_new_tokens=8) for i in range(4)]
                some = [self.request(f"some{i}", stop_token_ids=tuple(range(0, vocab, 2)), max_new_tokens=16)
                        for i in range(4)]
                reqs = {q.request_id: q for q in unasked + some}
                results = [r async for r in engine.generate(list(reqs.values()))]
                for r in results:
                    self.check_result(reqs[r.request_id], r, limit)
                for r in results:
                    if r.request_id.startswith("no-stop"):
                        assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 8, (
                            f"{r.request_id} has no stop ids but ended with {r.finish_reason.value}{_why(r)} after "
                            f"{len(r.token_ids)} of 8 tokens"
                        )
            finally:
                await engine.shutdown()

        self.run(body())

    def test_same_seed_samples_the_same_tokens(self, make_backend):
        """Requests with the same ``seed`` and prompt sample the same tokens, in one call or in two.

        ``SamplingParams.seed`` is part of the request: honour it (a
        generator per seeded request) or refuse the request with an ``error``
        result. Fix: draw a seeded request's tokens from its own generator.
        """

        async def body():
            engine = await self.started(make_backend)
            try:
                seeded = {"seed": 1234, "max_new_tokens": 12}
                first = {r.request_id: r async for r in engine.generate(
                    [self.request("seed-a", **seeded), self.request("seed-b", **seeded), self.request("free")])}
                (again,) = [r async for r in engine.generate([self.request("seed-c", **seeded)])]
                return first["seed-a"], first["seed-b"], again
            finally:
                await engine.shutdown()

        a, b, c = self.run(body())
        if {a.finish_reason, b.finish_reason, c.finish_reason} == {FinishReason.ERROR}:
            pytest.skip(f"the engine refuses seeded requests ({a.error}); SamplingParams allows honour or refuse")
        tokens = [[int(t) for t in _values(r.token_ids)] for r in (a, b, c)]
        assert tokens[0] == tokens[1], "two requests with one seed in one call sampled different tokens"
        assert tokens[0] == tokens[2], "a request with the same seed in a later call sampled different tokens"

    def test_a_failing_request_gets_an_error_result_and_the_rest_finish(self, make_backend):
        """A request the engine cannot serve (a token id outside the vocabulary) yields reason ``error``; others finish.

        Fix: check each request before it runs and report a problem as that
        request's result (``finish_reason=ERROR``, ``error`` saying why), never
        by raising out of ``generate`` (that ends every request of the call).
        """
        vocab = self.known_vocab(make_backend)

        async def body():
            engine = await self.started(make_backend)
            try:
                bad = GenerationRequest("bad", (*self.prompt_token_ids, vocab),
                                        SamplingParams(max_new_tokens=self.max_new_tokens))
                reqs = [self.request("good-0"), bad, self.request("good-1")]
                results = {r.request_id: r async for r in engine.generate(reqs)}
                assert sorted(results) == ["bad", "good-0", "good-1"]
                assert results["bad"].finish_reason is FinishReason.ERROR and results["bad"].error, (
                    "a prompt with a token id outside the vocabulary must come back with reason error and a message"
                )
                for rid in ("good-0", "good-1"):
                    assert results[rid].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                (after,) = [r async for r in engine.generate([self.request("after-bad")])]
                assert after.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                assert (await engine.health()).ok
            finally:
                await engine.shutdown()

        self.run(body())

    def test_context_limit_caps_the_completion_and_refuses_a_full_prompt(self, make_backend):
        """Prompt + completion stay within the model's context: ``length`` at the limit; a full prompt is an ``error``.

        The limit is the model's ``max_position_embeddings`` (or the spec
        class's ``context_limit``). Fix: generate at most ``limit - len(prompt)``
        tokens and end with ``length`` there; refuse a prompt that leaves no
        room with an ``error`` result.
        """
        ref = self.reference(make_backend)
        limit = self.context_limit or (ref.context_limit if ref is not None else None)
        if limit is None:
            pytest.skip("no context limit known: the engine serves no Hugging Face model and the spec class sets no "
                        "context_limit")
        vocab = self.known_vocab(make_backend)

        def prompt(n: int) -> tuple[int, ...]:
            return tuple(1 + i % (vocab - 1) for i in range(n))

        async def body():
            engine = await self.started(make_backend)
            try:
                near = GenerationRequest("near", prompt(limit - 3), SamplingParams(max_new_tokens=10))
                full = GenerationRequest("full", prompt(limit), SamplingParams(max_new_tokens=10))
                results = {r.request_id: r async for r in engine.generate([near, full])}
                assert results["full"].finish_reason is FinishReason.ERROR and results["full"].error, (
                    f"a prompt of {limit} tokens fills the context of {limit}: it must come back with reason error"
                )
                assert results["near"].finish_reason is FinishReason.LENGTH and len(results["near"].token_ids) == 3, (
                    f"a prompt of {limit - 3} tokens leaves room for 3 of the 10 asked: expected reason length after "
                    f"3 tokens, got {results['near'].finish_reason.value} after {len(results['near'].token_ids)}"
                )
            finally:
                await engine.shutdown()

        self.run(body())

    # -- abort and pause ------------------------------------------------------------------------------

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
                assert all(r.finish_reason is FinishReason.ABORT for r in results), (
                    f"aborted requests must end with reason abort, got {[r.finish_reason.value for r in results]}"
                )
                for r in results:
                    assert len(r.token_ids) == len(r.logprobs) == len(r.versions) < 10_000
            finally:
                await engine.shutdown()

        self.run(body())

    def test_abort_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_abort=False``, ``abort`` raises UnsupportedFeatureError."""
        engine = make_backend()
        forbid(engine.features, "supports_abort")
        self.run(expect_unsupported(engine.abort(None), "abort()"))

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

        self.run(body())

    def test_pause_keep_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_pause_keep=False``, ``pause(KEEP)`` raises UnsupportedFeatureError."""
        forbid(make_backend().features, "supports_pause_keep")

        async def body():
            engine = await self.started(make_backend)
            try:
                await expect_unsupported(engine.pause(PauseMode.KEEP), "pause(KEEP)")
            finally:
                await engine.shutdown()

        self.run(body())

    def test_restart_replaces_the_engine_when_declared(self, make_backend):
        """With ``supports_restart``, ``restart()`` leaves a started engine that generates again."""
        engine = make_backend()
        require(engine.features, "supports_restart")

        async def body():
            started = await self.started(make_backend)
            try:
                await started.restart()
                results = [r async for r in started.generate([self.request("after-restart")])]
                assert [r.request_id for r in results] == ["after-restart"]
            finally:
                await started.shutdown()

        self.run(body())

    def test_restart_unsupported_has_no_restart(self, make_backend):
        """Without ``supports_restart``, the runtime never restarts the engine: it offers no working ``restart``
        (absent, or raising UnsupportedFeatureError), so a dead replica is reported lost, not silently reused."""
        from asyncflow_core.errors import UnsupportedFeatureError

        engine = make_backend()
        forbid(engine.features, "supports_restart")
        restart = getattr(engine, "restart", None)
        if restart is not None:
            with pytest.raises(UnsupportedFeatureError):
                self.run(restart())

    def test_adapter_updates_unsupported_raise_documented_error(self, make_backend):
        """With ``supports_adapter_updates=False``, ``configure_adapter`` raises UnsupportedFeatureError."""
        from asyncflow_core.errors import UnsupportedFeatureError
        from asyncflow_core.types.adapter import LoraSpec

        engine = make_backend()
        forbid(engine.features, "supports_adapter_updates")
        with pytest.raises(UnsupportedFeatureError):
            engine.configure_adapter(LoraSpec())

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

        self.run(body())

    def test_sleep_releases_and_wake_up_restores_the_same_policy(self, make_backend):
        """With ``supports_sleep``, ``sleep`` then ``wake_up`` leaves the engine serving the same version.

        Fix: keep (level 1) or reload what ``sleep`` released before
        ``wake_up`` returns; the version does not change.
        """
        require(make_backend().features, "supports_sleep")

        async def body():
            engine = await self.started(make_backend)
            try:
                version = engine.version
                await engine.sleep(1)
                await engine.wake_up()
                assert engine.version == version
                (res,) = [r async for r in engine.generate([self.request("awake")])]
                assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                assert set(_values(res.versions)) == {version}
            finally:
                await engine.shutdown()

        self.run(body())

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

        self.run(body())

    def test_pause_wait_lets_in_flight_finish_and_holds_new_requests(self, make_backend):
        """``pause(WAIT)`` returns once the in-flight requests finished normally; new ones wait for ``resume``.

        Fix: stop admitting, wait for the running requests to end (reason
        stop or length, never abort), then return; hold later requests until
        ``resume()``.
        """
        limit = self.known_limit(make_backend)

        async def body():
            engine = await self.started(make_backend)
            try:
                reqs = {f"w{i}": self.request(f"w{i}", max_new_tokens=12) for i in range(2)}
                running = asyncio.ensure_future(_collect(engine.generate(list(reqs.values()))))
                await asyncio.sleep(0)
                await engine.pause(PauseMode.WAIT)
                # no resume(): the requests in flight when the pause came must finish on their own
                results = await asyncio.wait_for(running, 60)
                for r in results:
                    assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
                        f"pause(WAIT) must let in-flight requests finish; {r.request_id}{_why(r)} ended with "
                        f"{r.finish_reason.value}"
                    )
                    self.check_result(reqs[r.request_id], r, limit)
                held = asyncio.ensure_future(_collect(engine.generate([self.request("w-held", max_new_tokens=3)])))
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not held.done(), "a request sent after pause(WAIT) finished before resume()"
                await engine.resume()
                (res,) = await asyncio.wait_for(held, 60)
                assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            finally:
                await engine.shutdown()

        self.run(body())

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
                assert first.finish_reason is FinishReason.LENGTH, (
                    f"a request without stop ids ended with {first.finish_reason.value}{_why(first)} before max_new_tokens"
                )
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

        self.run(body())

    # -- log-probs and weights against the reference ---------------------------------------------------

    @pytest.mark.parametrize("case", list(CONVENTION_CASES))
    def test_logprobs_follow_the_sampling_convention(self, make_backend, case):
        """Each returned log-prob is log softmax(logits / T) after top-k and top-p, renormalised, of the model.

        Checked against the reference's full forward pass over prompt +
        completion (teacher forcing), within a tolerance derived from the
        engine's dtype. Raw log-probs (temperature, top-k, top-p ignored)
        break every importance ratio downstream. Fix: score the sampled token
        under the distribution it was sampled from
        (``asyncflow_core.types.sampling.sampling_logprobs``).
        """
        ref = self.needs_reference(make_backend)
        sampling = SamplingParams(max_new_tokens=12, **CONVENTION_CASES[case])

        async def body():
            engine = await self.started(make_backend)
            try:
                await self.known_weights(engine, ref)
                prompts = [(*self.prompt_token_ids[:-1], self.prompt_token_ids[-1] + i) for i in range(4)]
                reqs = [GenerationRequest(f"lp{i}", p, sampling) for i, p in enumerate(prompts)]
                return [r async for r in engine.generate(reqs)]
            finally:
                await engine.shutdown()

        results = self.run(body())
        self.assert_matches(ref, results, sampling, f"sampling {CONVENTION_CASES[case]}")

    def test_update_weights_moves_every_new_token_to_the_new_version(self, make_backend):
        """After ``update_weights(v)``, ``version`` is v and every token sampled afterwards carries v.

        Fix: apply all buckets, then set the version at a step boundary (the
        safe point), so no token mixes versions.
        """
        ref = self.reference(make_backend)
        tensors = self.update_tensors(ref, seed=1)

        async def body():
            engine = await self.started(make_backend)
            try:
                new = await self.push(engine, tensors)
                assert engine.version == new
                results = [r async for r in engine.generate([self.request(f"u{i}") for i in range(3)])]
                for r in results:
                    assert set(_values(r.versions)) == {new}, "tokens sampled after an update must carry its version"
            finally:
                await engine.shutdown()

        self.run(body())

    def test_update_weights_changes_the_policy_to_the_new_weights(self, make_backend):
        """After an update, the log-probs of sampled tokens are those of the new weights, not of the old ones.

        An engine that checks the buckets and bumps the version but never
        copies the tensors into its model fails here. Fix: load every
        received tensor into the model (mapping the trainer's names to your
        layout) before the version changes.
        """
        ref = self.needs_reference(make_backend)
        sampling = SamplingParams(max_new_tokens=12, temperature=1.0)

        async def body():
            engine = await self.started(make_backend)
            try:
                await self.known_weights(engine, ref)
                before = ref.snapshot()
                await self.push(engine, self.other_tensors(ref, seed=12), ref)
                reqs = [GenerationRequest(f"new{i}", (*self.prompt_token_ids, i), sampling) for i in range(4)]
                return before, [r async for r in engine.generate(reqs)]
            finally:
                await engine.shutdown()

        before, results = self.run(body())
        self.assert_matches(ref, results, sampling, "after update_weights")
        ref.restore(before)
        stale = compare(ref, results, sampling)
        assert stale.worst > 1.0, (
            "the pushed weights do not change the policy beyond the tolerance, so this test cannot tell an applied "
            "update from an ignored one: make weights() return other values than the engine starts with"
        )

    def test_held_requests_continue_on_the_new_weights(self, make_backend):
        """With ``supports_inflight_weight_update``: requests held by ``pause(KEEP)`` continue on the update's weights.

        Tokens sampled before the update carry the old version and its
        log-probs, tokens after ``resume`` the new version and the new
        weights' log-probs over the whole context (``kv_cache=RECOMPUTE``).
        Fix: apply the update while requests are held, recompute their cache
        with the new weights, tag new tokens with the new version.
        """
        require(make_backend().features, "supports_inflight_weight_update")
        require(make_backend().features, "supports_pause_keep")
        ref = self.reference(make_backend)
        sampling = SamplingParams(max_new_tokens=self.held_new_tokens)
        tensors = self.other_tensors(ref, seed=13)

        async def body():
            engine = await self.started(make_backend)
            try:
                if ref is not None:
                    await self.known_weights(engine, ref)
                old_version, old = engine.version, ref.snapshot() if ref is not None else None
                reqs = [GenerationRequest(f"h{i}", self.prompt_token_ids, sampling) for i in range(2)]
                short = self.request("h-short", max_new_tokens=2)
                stream = engine.generate([*reqs, short]).__aiter__()
                early = []
                while not any(r.request_id == "h-short" for r in early):
                    early.append(await stream.__anext__())  # the long ones decoded beside it meanwhile
                await engine.pause(PauseMode.KEEP)
                new_version = await self.push(engine, tensors, ref, kv_cache=KVCachePolicy.RECOMPUTE)
                await engine.resume()
                rest = [r async for r in stream]
                return old_version, old, new_version, [r for r in early + rest if r.request_id != "h-short"]
            finally:
                await engine.shutdown()

        old_version, old, new_version, held = self.run(body())
        assert sorted(r.request_id for r in held) == ["h0", "h1"]
        limit = self.known_limit(make_backend)
        for r in held:
            self.check_result(GenerationRequest(r.request_id, self.prompt_token_ids, sampling), r, limit)
            versions = [int(v) for v in _values(r.versions)]
            seen = (f"{r.request_id}: {versions.count(old_version)} tokens at version {old_version}, "
                    f"{versions.count(new_version)} at {new_version}, finish reason {r.finish_reason.value}")
            assert versions == sorted(versions), f"{seen}; versions go backwards"
            assert set(versions) <= {old_version, new_version}, f"{seen}; other versions {sorted(set(versions))}"
            assert old_version in versions, f"{seen}: no token before the update, so it was not held in flight"
            assert new_version in versions, f"{seen}: no token after the update (it must continue after resume)"
        if ref is not None:
            def at(version: int):
                return lambda res, i: int(_values(res.versions)[i]) == version

            self.assert_matches(ref, held, sampling, "tokens sampled after the in-flight update",
                                select=at(new_version))
            ref.restore(old)
            self.assert_matches(ref, held, sampling, "tokens sampled before the in-flight update",
                                select=at(old_version))

    def test_inflight_update_unsupported_raises_documented_error(self, make_backend):
        """With ``supports_inflight_weight_update=False``, an update while requests are held is unsupported.

        It raises UnsupportedFeatureError.

        The held requests then finish on the old version after ``resume``.
        """
        forbid(make_backend().features, "supports_inflight_weight_update")
        require(make_backend().features, "supports_pause_keep")
        tensors = self.update_tensors(self.reference(make_backend), seed=14)

        async def body():
            engine = await self.started(make_backend)
            try:
                version = engine.version
                task = asyncio.ensure_future(_collect(engine.generate([self.request("ik", max_new_tokens=64)])))
                await asyncio.sleep(0)
                await engine.pause(PauseMode.KEEP)
                await expect_unsupported(self.push(engine, tensors), "update_weights() while requests are held")
                assert engine.version == version
                await engine.resume()
                (res,) = await task
                assert set(_values(res.versions)) == {version}
            finally:
                await engine.shutdown()

        self.run(body())

    def test_bad_bucket_is_refused_and_keeps_the_old_version(self, make_backend):
        """A corrupted bucket raises WeightTransferError, and the old version stays in force.

        Fix: call ``bucket.verify()`` on every bucket and check names and
        shapes before touching a parameter.
        """
        tensors = self.update_tensors(self.reference(make_backend), seed=1)

        async def body():
            engine = await self.started(make_backend)
            try:
                old = engine.version
                buckets = _buckets(tensors, old + 1)
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

        self.run(body())

    def test_loads_what_the_paired_trainer_exports(self, make_backend, tmp_path):
        """The weights a trainer exports (its names, shapes, dtypes, tied tensors sent once) load into the engine.

        The trainer is ``paired_trainer`` (default ``fsdp`` for an engine that
        serves a Hugging Face model), built on the same architecture with
        other weights; its ``export_weights`` is pushed as an update, and the
        engine's log-probs must then be those of the exported tensors. A run
        pushes exactly this at its first step. Fix: accept the trainer's
        names (Hugging Face ``state_dict`` keys for ``fsdp``), including a
        tied ``lm_head`` sent only as ``model.embed_tokens.weight``.
        """
        ref = self.needs_reference(make_backend)
        trainer = self.paired_trainer or ("fsdp" if isinstance(ref, HFReference) else None)
        if trainer is None:
            pytest.skip("no paired_trainer set: name the train engine whose export this engine loads")
        sampling = SamplingParams(max_new_tokens=12, temperature=0.9)
        exported = self.run(self._export_of(trainer, ref, tmp_path))

        async def body():
            engine = await self.started(make_backend)
            try:
                await self.push(engine, exported, ref)
                reqs = [GenerationRequest(f"tr{i}", (*self.prompt_token_ids, i), sampling) for i in range(3)]
                return [r async for r in engine.generate(reqs)]
            finally:
                await engine.shutdown()

        results = self.run(body())
        self.assert_matches(ref, results, sampling, f"after loading the {trainer!r} trainer's export")

    async def _export_of(self, trainer: str, ref: Reference, tmp_path: Path) -> dict[str, torch.Tensor]:
        """The named tensors ``trainer`` exports, in its order (the suite's emulation when it is not installed)."""
        pm = get_plugin_manager()
        if trainer not in pm.registrations(PluginKind.TRAIN_ENGINE):
            made = ref.fresh_weights(seed=15)
            if made is None:
                pytest.skip(f"train engine {trainer!r} is not installed")
            warnings.warn(f"train engine {trainer!r} is not installed: checked the Hugging Face trainers' export "
                          "format (state_dict names, tied tensors once, the model's dtype) instead", stacklevel=2)
            return made
        options = dict(self.paired_trainer_options)
        config_fields = getattr(pm.lookup(PluginKind.TRAIN_ENGINE, trainer).record.config_model, "model_fields", {})
        if "model" in config_fields and "model" not in options:
            saved = ref.save_model(tmp_path / "trainer-model", seed=15)
            if saved is None:
                pytest.skip(f"the suite cannot build a model for trainer {trainer!r}: set paired_trainer_options")
            options["model"] = {"path": str(saved), "dtype": str(getattr(ref, "dtype", torch.float32)).split(".")[-1]}
        engine = pm.create(PluginKind.TRAIN_ENGINE, trainer, options)
        await engine.setup()
        try:
            buckets = [b async for b in engine.export_weights(bucket_bytes=1 << 16)]
        finally:
            await engine.shutdown()
        return {name: tensor.clone() for b in buckets for name, tensor in b.tensors()}

    def test_declared_weight_transports_are_installed(self, make_backend):
        """Every name in ``weight_transports`` is an installed weight transport, so a run config can pick it.

        Fix: declare only transports this engine can receive from, by their
        registered names (``asyncflow plugins --kind weight_transport``).
        """
        declared = make_backend().features.weight_transports
        installed = get_plugin_manager().registrations(PluginKind.WEIGHT_TRANSPORT)
        assert declared, "weight_transports is empty: the engine could never receive a weight update"
        missing = [name for name in declared if name not in installed]
        assert not missing, f"weight_transports names {missing}, not installed; installed: {sorted(installed)}"

    def test_health_and_double_shutdown(self, make_backend):
        """``health`` answers a Health model; ``shutdown`` twice is safe."""

        async def body():
            engine = await self.started(make_backend)
            health = await engine.health()
            assert isinstance(health, Health) and health.ok
            await engine.shutdown()
            await engine.shutdown()

        self.run(body())


def _why(result: GenerationResult) -> str:
    """The engine's own reason for an error result, for an assertion message (empty otherwise)."""
    return f" ({result.error})" if result.finish_reason is FinishReason.ERROR and result.error else ""


def _values(seq: Any) -> list:
    """The Python numbers of a result field: the contract allows a sequence or a 1-D tensor."""
    if isinstance(seq, torch.Tensor):
        assert seq.dim() == 1, f"a result tensor must be 1-D, got shape {tuple(seq.shape)}"
        return seq.tolist()
    return list(seq)


def _buckets(tensors: Mapping[str, torch.Tensor], version: int) -> list[WeightBucket]:
    # small buckets, so an update has several and the bad-bucket test can spoil one in the middle
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return list(pack_buckets(tensors.items(), version=version, bucket_bytes=max(1, total // 3)))


async def _feed(buckets):
    for bucket in buckets:
        yield bucket


async def _collect(stream):
    return [r async for r in stream]
