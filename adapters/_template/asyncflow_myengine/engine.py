"""``myengine``: the RolloutEngine contract (asyncflow_core/interfaces/rollout.py) on a Hugging Face causal LM.

Read the interface's docstrings next to this file: each method below says in
a comment which clause of the contract it implements. To adapt the template
to your engine, keep the bookkeeping (request states, abort flags, the pause
events, the version snapshot per step) and replace the calls into
``model.py`` (``load``, ``next_logits``) and ``_load`` with calls into your
engine.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core.errors import ConfigError, EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine, RolloutFeatures
from asyncflow_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    ModelTensors,
    WeightBucket,
    collect_update,
)
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_myengine.config import FEATURES, MyEngineConfig
from asyncflow_myengine.model import context_limit, load, next_logits, vocab_size


@dataclass
class _Request:
    """One request in flight: what was generated so far and the model state to continue from."""

    request: GenerationRequest
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # tokens the model has not consumed yet
    cache: Any = None  # the KV cache of the consumed tokens
    cache_version: int = -1  # the weights that computed ``cache``
    aborted: bool = False
    finish: FinishReason | None = None
    error: str | None = None


class MyEngine(RolloutEngine):
    """Serves one policy replica: every ``generate`` call decodes its requests, one token each per step.

    The event loop runs between steps (the model runs in a worker thread), so
    ``abort``, ``pause`` and ``update_weights`` take effect at step
    boundaries: the safe point where no token is sampled from a mix of versions.
    """

    def __init__(self, config: MyEngineConfig) -> None:
        if config.model is None:
            raise ConfigError("myengine needs a model: set the run's `model` section (path or hf_config) "
                              "or rollout.options.model")
        self.config = config
        self._model: torch.nn.Module | None = None
        self._vocab = 0
        self._limit: int | None = None
        self._version = 0
        self._kv_policy = KVCachePolicy.RECOMPUTE
        self._requests: dict[str, _Request] = {}
        self._accepting = asyncio.Event()  # cleared by pause(): new requests wait for resume()
        self._accepting.set()
        self._running = asyncio.Event()  # cleared by pause(KEEP): requests in flight wait, cache kept
        self._running.set()
        self._idle = asyncio.Event()  # set when no request is in flight
        self._idle.set()
        self._wake = asyncio.Event()  # replaced on every abort / resume: paused loops look again
        self._generator = torch.Generator().manual_seed(config.sampling_seed)
        # one decoding step at a time across generate() calls: they share the model and the generator
        self._step_lock = asyncio.Lock()
        self._closed = False

    # -- identity ------------------------------------------------------------------------------------

    @property
    def features(self) -> RolloutFeatures:
        return FEATURES

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        # contract: load the model; a failure is an EngineError with the reason
        assert self.config.model is not None
        try:
            net = await asyncio.to_thread(load, self.config.model, self.config.init_seed, self.config.device)
        except (ConfigError, EngineError):
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            raise EngineError(f"myengine could not load its model on {self.config.device!r}: {exc}") from exc
        self._vocab, self._limit = vocab_size(net), context_limit(net)
        self._model = net

    def _started(self) -> torch.nn.Module:
        if self._closed:
            raise EngineError("myengine was shut down; build a new engine")
        if self._model is None:
            raise EngineError("call start() before using myengine")
        return self._model

    # -- generation ----------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        self._started()
        # contract: a duplicate id among in-flight requests is a ValueError before anything is generated
        ids = [r.request_id for r in requests]
        dupes = sorted({i for i in ids if ids.count(i) > 1} | (set(ids) & set(self._requests)))
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {dupes}")
        await self._accepting.wait()  # paused: new requests wait for resume()
        mine = [self._admit(r) for r in requests]
        self._idle.clear()
        try:
            while mine:
                if not self._running.is_set() and not any(s.aborted or s.finish for s in mine):
                    await self._wake.wait()  # paused with KEEP: only an abort, resume or shutdown moves us
                    continue
                live = [s for s in mine if not s.aborted and s.finish is None]
                if live and self._running.is_set():
                    # snapshot the weights and their version: an update landing during this step is
                    # used from the next step on, so every token carries the version that sampled it
                    async with self._step_lock:
                        model, version = self._started(), self._version
                        await asyncio.to_thread(self._decode_step, model, version, live)
                for s in [s for s in mine if s.aborted or s.finish is not None]:
                    mine.remove(s)
                    del self._requests[s.request.request_id]
                    yield self._result(s)
                await asyncio.sleep(0)  # the safe point: abort / pause / update_weights act here
        finally:
            for s in mine:  # the consumer stopped iterating: forget what it will never read
                self._requests.pop(s.request.request_id, None)
            if not self._requests:
                self._idle.set()

    def _admit(self, r: GenerationRequest) -> _Request:
        sp = r.sampling
        # contract (SamplingParams): a per-request seed gets its own generator; None draws from the engine's
        generator = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else self._generator
        state = _Request(
            r,
            generator,
            # contract (supports_resume_prefix): continue after the aborted attempt's tokens and return them
            tokens=list(r.prefix_token_ids),
            logprobs=list(r.prefix_logprobs),
            versions=list(r.prefix_versions),
            pending=[*r.prompt_token_ids, *r.prefix_token_ids],
        )
        # contract: a request this engine cannot serve gets its own error result; the others go on
        state.error = self._problem(r)
        if state.error is not None:
            state.finish = FinishReason.ERROR
        elif state.tokens and state.tokens[-1] in sp.stop_token_ids:
            state.finish = FinishReason.STOP
        elif len(state.tokens) >= sp.max_new_tokens:
            state.finish = FinishReason.LENGTH
        self._requests[r.request_id] = state
        return state

    def _problem(self, r: GenerationRequest) -> str | None:
        """Why this request cannot be served (its error result), or None."""
        bad = [t for t in (*r.prompt_token_ids, *r.prefix_token_ids) if not 0 <= t < self._vocab]
        if bad:
            return f"token ids outside the model's vocabulary [0, {self._vocab}): {bad[:5]}"
        context = len(r.prompt_token_ids) + len(r.prefix_token_ids)
        if self._limit is not None and context >= self._limit:
            return f"prompt + prefix is {context} tokens; the model takes {self._limit}, leaving no room to generate"
        return None

    def _decode_step(self, model: torch.nn.Module, version: int, states: list[_Request]) -> None:
        """One token for every live request (runs in a worker thread; replace with your engine's step)."""
        for s in states:
            if s.cache is not None and s.cache_version != version and self._kv_policy is KVCachePolicy.RECOMPUTE:
                # the weights changed under this request: recompute its cache with the new ones
                s.cache, s.pending = None, [*s.request.prompt_token_ids, *s.tokens]
            logits, s.cache = next_logits(model, s.pending, s.cache, self.config.device)
            s.cache_version, s.pending = version, []
            sp = s.request.sampling
            # the shared log-prob convention: temperature, top-k, top-p, renormalised (SamplingParams)
            logp = sampling_logprobs(logits, sp.temperature, sp.top_p, sp.top_k)
            token = int(torch.multinomial(logp.exp(), 1, generator=s.generator))
            s.tokens.append(token)
            s.logprobs.append(float(logp[token]))
            s.versions.append(version)
            s.pending.append(token)
            # contract: only the request's stop ids end it early (the model's EOS only when listed there);
            # max_new_tokens and the model's context end it with reason length
            if token in sp.stop_token_ids:
                s.finish = FinishReason.STOP
            elif len(s.tokens) >= sp.max_new_tokens:
                s.finish = FinishReason.LENGTH
            elif self._limit is not None and len(s.request.prompt_token_ids) + len(s.tokens) >= self._limit:
                s.finish = FinishReason.LENGTH

    @staticmethod
    def _result(s: _Request) -> GenerationResult:
        # contract: aborted requests come out of generate() with finish reason ABORT and their partial tokens
        reason = FinishReason.ABORT if s.aborted and s.finish is None else s.finish
        r = s.request
        return GenerationResult(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=tuple(s.tokens),
            logprobs=tuple(s.logprobs),
            versions=tuple(s.versions),
            finish_reason=reason,
            error=s.error,
            metadata=r.metadata,
        )

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        # contract: mark them; the generate() call that owns them hands back the partial results;
        # return only the ids actually aborted (unknown and finished ones are ignored)
        targets = list(self._requests) if request_ids is None else [i for i in request_ids if i in self._requests]
        targets = [i for i in targets if self._requests[i].finish is None and not self._requests[i].aborted]
        for rid in targets:
            self._requests[rid].aborted = True
        self._signal()  # a loop paused with KEEP hands its aborted requests back
        return targets

    def _signal(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # -- pause, weights, memory ----------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        self._started()
        self._accepting.clear()
        if mode is PauseMode.KEEP:
            # contract: hold requests where they are, cache included; return once no step is running
            self._running.clear()
            async with self._step_lock:
                return
        if mode is PauseMode.ABORT:
            await self.abort(None)
        await self._idle.wait()  # ABORT and WAIT return once quiescent: nothing in flight until resume()

    async def resume(self) -> None:
        self._accepting.set()
        self._running.set()
        self._signal()

    async def update_weights(
        self, version: int, buckets: AsyncIterable[WeightBucket], *, kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE
    ) -> None:
        model = self._started()
        kv_policy = KVCachePolicy(kv_cache)
        # build the new weights aside: a bad bucket leaves the old weights and version in force. collect_update
        # makes every check the contract asks for (checksums, one version, names/shapes/dtypes of the model, no
        # duplicates, complete with a tied group covered by any one of its names, ends with the last bucket) and
        # says which failed (WeightTransferError). The names are the model's state_dict keys: the Hugging Face
        # names the trainers export
        checked = await collect_update(version, buckets, model=ModelTensors.of(model.state_dict(keep_vars=True)))
        # bucket tensors are views of a buffer the sender may reuse: copy what you keep
        received = {name: tensor.clone() for bucket in checked for name, tensor in bucket.tensors()}
        new_model = await asyncio.to_thread(self._load, model, received)
        # no await between these lines: the next decoding step sees both or neither. Requests held by
        # pause(KEEP) continue on the new weights after resume(), their cache per ``kv_cache``
        self._model, self._version, self._kv_policy = new_model, version, kv_policy

    @staticmethod
    def _load(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A copy of ``model`` holding ``tensors`` (replace with your engine's weight loader).

        ``strict=False`` because a tied tensor arrives under one name only
        (``lm_head.weight`` is ``model.embed_tokens.weight``): the copy keeps
        the tie, and ``collect_update`` already checked that nothing is missing.
        """
        fresh = copy.deepcopy(model)
        with torch.no_grad():
            fresh.load_state_dict(tensors, strict=False)
        return fresh

    async def sleep(self, level: int = 1) -> None:
        raise UnsupportedFeatureError("myengine has no device memory to release (supports_sleep=False)")

    async def wake_up(self) -> None:
        raise UnsupportedFeatureError("myengine has no device memory to release (supports_sleep=False)")

    # -- lifecycle -----------------------------------------------------------------------------------

    async def health(self) -> Health:
        # contract: cheap, never waits on generation
        if self._closed:
            return Health(ok=False, detail="shut down")
        if self._model is None:
            return Health(ok=False, detail="not started")
        paused = not self._accepting.is_set()
        return Health(ok=True, detail="paused" if paused else "", in_flight=len(self._requests))

    async def shutdown(self) -> None:
        # contract: abort what is in flight, free resources; safe to call twice
        if self._closed:
            return
        await self.abort(None)
        await self.resume()  # requests waiting for resume() run into the closed engine's error
        self._closed = True
        self._model = None
