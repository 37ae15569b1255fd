"""``toy`` rollout engine: batched sampling from the bigram policy, with every optional contract honoured."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import EngineError, UnsupportedFeatureError, WeightTransferError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine, RolloutFeatures
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, ModelTensors, WeightBucket
from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table, sampling_logprobs

FEATURES = RolloutFeatures(
    supports_abort=True,
    supports_resume_prefix=True,
    supports_pause_keep=True,
    supports_pause_abort=True,
    supports_inflight_weight_update=True,
    supports_sleep=False,
    weight_transports=("inprocess",),
)


class ToyRolloutConfig(BaseModel):
    """Options of the ``toy`` rollout engine."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(16, ge=2, description="Vocabulary size of the bigram table.")
    seed: int = Field(0, description="Seed of the version-0 table (use the trainer's seed to start in sync).")
    init_scale: float = Field(1.0, ge=0, description="Std of the random version-0 logits.")
    sampling_seed: int = Field(1, description="Seed of the engine's shared generator (requests without a seed).")
    max_batch: int = Field(256, ge=1, description="Requests decoded together in one step.")

    def accepts_weights(self, model: object, weights: Mapping[str, Sequence[int]]) -> None:
        """``ValueError`` unless ``weights`` is the bigram table this engine loads (the config-time pairing check)."""
        from asyncflow_core.config.pairing import check_against

        check_against(ModelTensors({PARAM_NAME: ((self.vocab_size, self.vocab_size), torch.float32)}), weights)


@dataclass
class _Active:
    request: GenerationRequest
    prev: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    abort: bool = False
    #: the request's own sampling generator when it carries ``SamplingParams.seed`` (else the engine's shared one):
    #: its tokens then depend on the seed alone, not on which other requests share the call or the step
    generator: torch.Generator | None = None


class ToyRolloutEngine(RolloutEngine):
    """Decodes all of one ``generate`` call's requests in lock-step, one token per step.

    A request with ``SamplingParams.seed`` samples from a generator of its
    own (same seed and prompt: same tokens, whatever else is in flight);
    the others share the engine's generator (``sampling_seed``). A request
    the engine cannot serve (an empty prompt, a token outside the
    vocabulary) comes back as its own ``error`` result.

    The event loop runs between steps, so ``abort``, ``pause`` and
    ``update_weights`` act at step boundaries — the safe point: no token is
    ever sampled from a mix of versions.
    """

    def __init__(self, config: ToyRolloutConfig) -> None:
        self.config = config
        self._table: torch.Tensor | None = None
        self._version = 0
        self._active: dict[str, _Active] = {}
        self._running = asyncio.Event()
        self._running.set()
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake = asyncio.Event()
        self._gen = torch.Generator().manual_seed(config.sampling_seed)
        self._shut = False

    @property
    def features(self) -> RolloutFeatures:
        return FEATURES

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        self._table = initial_table(self.config.vocab_size, self.config.seed, self.config.init_scale)

    def _check_started(self) -> torch.Tensor:
        if self._shut:
            raise EngineError("the toy engine was shut down")
        if self._table is None:
            raise EngineError("call start() before using the toy engine")
        return self._table

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        table = self._check_started()
        ids = [r.request_id for r in requests]
        dupes = {i for i in ids if ids.count(i) > 1} | (set(ids) & set(self._active))
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {sorted(dupes)}")
        vocab = table.shape[0]
        # a request the engine cannot serve is that request's ERROR result; the others of the call run on
        refused = [(r, why) for r in requests if (why := self._problem(r, vocab)) is not None]
        for r, why in refused:
            yield GenerationResult(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=(),
                                   logprobs=(), versions=(), finish_reason=FinishReason.ERROR, error=why,
                                   metadata=r.metadata)
        refused_ids = {r.request_id for r, _ in refused}
        await self._accepting.wait()
        mine = []
        for r in requests:
            if r.request_id in refused_ids:
                continue
            seed = r.sampling.seed
            state = _Active(
                r,
                prev=(r.prefix_token_ids or r.prompt_token_ids)[-1],
                tokens=list(r.prefix_token_ids),
                logprobs=list(r.prefix_logprobs),
                versions=list(r.prefix_versions),
                generator=None if seed is None else torch.Generator().manual_seed(seed),
            )
            self._active[r.request_id] = state
            mine.append(state)
        self._idle.clear()
        try:
            while mine:
                if self._running.is_set():
                    finished = self._step(mine)
                else:  # paused: only aborted requests move (they finish without sampling)
                    finished = [(s, FinishReason.ABORT) for s in mine if s.abort]
                    if not finished:
                        await self._wait_signal()
                        continue
                for state, reason in finished:
                    mine.remove(state)
                    del self._active[state.request.request_id]
                    yield self._result(state, reason)
                await asyncio.sleep(0)  # the safe point: abort / pause / update act here
        finally:
            for state in mine:
                self._active.pop(state.request.request_id, None)
            if not self._active:
                self._idle.set()

    @staticmethod
    def _problem(r: GenerationRequest, vocab: int) -> str | None:
        """Why request ``r`` cannot be served (its ERROR result says so), or None."""
        if not r.prompt_token_ids and not r.prefix_token_ids:
            return f"request {r.request_id!r} has an empty prompt; the toy engine needs a token to condition on"
        bad = [t for t in (*r.prompt_token_ids, *r.prefix_token_ids) if not 0 <= t < vocab]
        if bad:
            return (f"request {r.request_id!r} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}; "
                    "raise vocab_size in rollout.options and trainer.options, or keep prompt tokens below it")
        return None

    def _step(self, states: list[_Active]) -> list[tuple[_Active, FinishReason]]:
        finished: list[tuple[_Active, FinishReason]] = []
        live = []
        for s in states:
            if s.abort:
                finished.append((s, FinishReason.ABORT))
            elif len(s.tokens) >= s.request.sampling.max_new_tokens:
                finished.append((s, FinishReason.LENGTH))
            else:
                live.append(s)
        assert self._table is not None
        for chunk_start in range(0, len(live), self.config.max_batch):
            chunk = live[chunk_start : chunk_start + self.config.max_batch]
            # requests with equal sampling parameters share one vectorised draw
            groups: dict[tuple[float, float, int], list[_Active]] = {}
            for s in chunk:
                sp = s.request.sampling
                groups.setdefault((sp.temperature, sp.top_p, sp.top_k), []).append(s)
            for (temp, top_p, top_k), members in groups.items():
                prev = torch.tensor([s.prev for s in members])
                logp = sampling_logprobs(self._table[prev], temp, top_p, top_k)
                probs = logp.exp()
                shared = [i for i, s in enumerate(members) if s.generator is None]
                tokens = torch.empty(len(members), dtype=torch.int64)
                if shared:  # unseeded requests: one draw from the engine's generator
                    tokens[shared] = torch.multinomial(probs[shared], 1, generator=self._gen).squeeze(1)
                for i, s in enumerate(members):  # seeded requests: each from its own generator
                    if s.generator is not None:
                        tokens[i] = torch.multinomial(probs[i], 1, generator=s.generator)[0]
                picked = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
                for s, tok, lp in zip(members, tokens.tolist(), picked.tolist(), strict=True):
                    s.tokens.append(tok)
                    s.logprobs.append(lp)
                    s.versions.append(self._version)
                    s.prev = tok
                    if tok in s.request.sampling.stop_token_ids:
                        finished.append((s, FinishReason.STOP))
                    elif len(s.tokens) >= s.request.sampling.max_new_tokens:
                        finished.append((s, FinishReason.LENGTH))
        return finished

    @staticmethod
    def _result(state: _Active, reason: FinishReason) -> GenerationResult:
        r = state.request
        return GenerationResult(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=tuple(state.tokens),
            logprobs=tuple(state.logprobs),
            versions=tuple(state.versions),
            finish_reason=reason,
            metadata=r.metadata,
        )

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        targets = list(self._active) if request_ids is None else [i for i in request_ids if i in self._active]
        for rid in targets:
            self._active[rid].abort = True
        self._signal()  # paused loops wake up to hand back the aborted requests
        return targets

    def _signal(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def _wait_signal(self) -> None:
        await self._wake.wait()

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._check_started()
        mode = PauseMode(mode)
        self._accepting.clear()
        if mode is PauseMode.ABORT:
            await self.abort(None)
            await self._idle.wait()
        elif mode is PauseMode.WAIT:
            await self._idle.wait()
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()
        self._accepting.set()
        self._signal()

    async def update_weights(
        self, version: int, buckets: AsyncIterable[WeightBucket], *, kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE
    ) -> None:
        table = self._check_started()
        new_table = None
        async for bucket in buckets:
            bucket.verify()
            if bucket.version != version:
                raise WeightTransferError(f"bucket of version {bucket.version} in an update to version {version}")
            for name, tensor in bucket.tensors():
                if name != PARAM_NAME:
                    raise WeightTransferError(f"unknown parameter {name!r}; the toy engine has only {PARAM_NAME!r}")
                if tuple(tensor.shape) != tuple(table.shape):
                    raise WeightTransferError(f"{name}: shape {tuple(tensor.shape)} != engine's {tuple(table.shape)}")
                new_table = tensor.to(table.dtype).clone()
        if new_table is None:
            raise WeightTransferError(f"update to version {version} carried no {PARAM_NAME!r}")
        # no await between these two lines: the swap is atomic with respect to decoding steps
        self._table = new_table
        self._version = version
        # the bigram policy keeps no KV cache: both policies are trivially honoured

    async def sleep(self, level: int = 1) -> None:
        raise UnsupportedFeatureError("the toy engine holds no device memory to release (supports_sleep=False)")

    async def wake_up(self) -> None:
        raise UnsupportedFeatureError("the toy engine holds no device memory to release (supports_sleep=False)")

    async def health(self) -> Health:
        if self._shut:
            return Health(ok=False, detail="shut down")
        if self._table is None:
            return Health(ok=False, detail="not started")
        return Health(ok=True, detail="paused" if not self._running.is_set() else "", in_flight=len(self._active))

    async def shutdown(self) -> None:
        if self._shut:
            return
        await self.abort(None)
        self._shut = True
        await self.resume()
