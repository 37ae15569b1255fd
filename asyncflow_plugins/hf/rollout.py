"""``torch`` rollout engine: any Hugging Face causal LM, batched decoding with a KV cache, in plain PyTorch.

The reference inference engine: no server, no custom kernels, one replica per
engine object, on the CPU or one CUDA device. What it does, step by step:

- **Continuous batching.** One scheduler task owns a running batch of at most
  ``max_batch`` sequences. Every step decodes one token for each running
  sequence; requests from any ``generate`` call join between steps (their
  prompt is prefilled in the same step) and leave the moment they finish, so
  a long completion never holds back the short ones.
- **KV cache layout.** The cached keys/values of the running batch are
  right-aligned: sequence ``i`` occupies the last ``len_i`` cache slots and
  the slots before them are padding, hidden by the 2-D attention mask.
  Position ids are passed per row (a row's token count), so rotary or
  learned positions never see the padding. Joining pads the shorter side on
  the left; leaving drops the row and then the all-padding leading columns.
  The tensors live in a ``transformers`` ``DynamicCache`` for each forward.
- **Shared rows** (``share_contexts``, default on). A cache row holds one
  distinct context, not one sequence: the n samples of a prompt prefill as
  one row and stay one row while they sample the same tokens; after each
  step the sequences of a row are regrouped by the token each sampled, and a
  row with several distinct tokens is copied into one row per token. Every
  sequence samples its own token (and gets its own log-prob) from its row's
  logits, so the results are those of one row per sequence, which
  ``share_contexts=False`` runs, to float rounding.
- **Log-prob convention** (the trainer's, see
  :class:`~asyncflow_core.types.SamplingParams`): a token's log-prob is
  taken from the distribution it was *sampled from* — logits in float32,
  divided by the temperature, then top-k, then top-p truncation,
  renormalised (:func:`asyncflow_core.types.sampling.sampling_logprobs`, the
  one function the toy engines use, so the conventions cannot drift). A
  full forward pass over prompt + completion, scored with that function,
  reproduces the returned log-probs (float32: to ~1e-6).
- **Versions.** Every token carries the ``version`` of the weights that
  sampled it. ``update_weights`` swaps weights between two steps (the safe
  point), so no token comes from a mix of versions.
- **Weights** arrive as :class:`~asyncflow_core.types.WeightBucket` s whose
  tensor names are the model's ``state_dict`` keys. All buckets are received
  and checked (checksum, version, name, shape, dtype, full coverage) before
  the first parameter is touched; then each model tensor becomes a view of
  its received tensor (``weight_load="view"``, where device, dtype and shape
  match: no copy, :class:`~asyncflow_core.types.weights.WeightLoader`) or is
  copied into.
- **LoRA adapters** (:meth:`TorchRolloutEngine.configure_adapter`, then
  adapter-only updates under peft's state-dict names): ``lora_mode="merged"``
  (default) keeps a copy of every targeted base weight ``W0`` and sets
  ``W = W0 + scaling * B @ A`` for each version (float32 arithmetic, then the
  model's dtype; never an accumulation of merges), ``modules_to_save``
  weights replacing their base; ``lora_mode="live"`` injects peft's LoRA
  layers into the model once and loads each version's tensors into them
  (``set_peft_model_state_dict``). The scaling comes from peft's own layer
  (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, per-module patterns).
  An adapter-only update advances :attr:`version` like any update, so the
  per-token ``versions`` name the adapter that sampled each token.
- **What ends a completion**: a token in the request's ``stop_token_ids``
  (or the optional engine-wide ``eos_token_ids``), ``max_new_tokens``, or
  the model's context. The model config's EOS counts only when the request
  lists it (the runtime does, for the model's or the task's end token).
- **The event loop stays free.** Every forward pass (and the weight copy)
  runs in a worker thread via :func:`asyncio.to_thread`; ``abort``,
  ``pause`` and ``update_weights`` act at step boundaries. The worker decodes
  step after step while nothing on the loop's side wants in (finished
  sequences are handed to the loop as they finish), so a busy event loop does
  not stall decoding between steps.

Options: :class:`TorchRolloutConfig`. Features: :data:`FEATURES`
(sleep/wake is not offered). Written for decoder-only models whose cache is a
plain key/value ``DynamicCache`` (Llama, Qwen2/3, Mistral, Gemma, GPT-2 ...).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.config.models import ModelConfig
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
from asyncflow_core.types.generation import with_version_range
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_core.types.weights import LoadInterrupted, WeightLoader, dtype_from_name

if TYPE_CHECKING:
    from asyncflow_core.types.adapter import LoraSpec

FEATURES = RolloutFeatures(
    supports_abort=True,
    supports_resume_prefix=True,
    supports_pause_keep=True,
    supports_pause_abort=True,
    supports_inflight_weight_update=True,
    supports_sleep=False,
    supports_adapter_updates=True,
    weight_transports=("inprocess",),
)

#: most decoding steps one worker-thread call runs back to back (:meth:`TorchRolloutEngine._steps`)
_STEPS_PER_CALL = 64


class TorchRolloutConfig(BaseModel):
    """Options of the ``torch`` rollout engine."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig | None = Field(
        None, description="The policy (path or hf_config, dtype); filled from the run's `model` section when unset."
    )
    device: str = Field(
        "auto", pattern=r"^(cpu|auto|cuda(:\d+)?)$", description="cpu, cuda, cuda:N, or auto (cuda when available)."
    )
    seed: int = Field(0, description="Seed of the sampling generator (the runtime gives replica i seed + 7919 i).")
    init_seed: int = Field(
        0,
        description="Seed of the random initial weights when the model is built from model.hf_config "
        "(use the trainer's).",
    )
    max_batch: int = Field(64, ge=1, description="Most sequences decoded together; more requests wait for a free slot.")
    eos_token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids that end every completion besides each request's stop_token_ids; default none: "
        "what ends a completion is the request's stop ids and max_new_tokens (the runtime lists the model's or "
        "the task's end token there), never the model config's eos unasked.",
    )
    lora_mode: Literal["merged", "live"] = Field(
        "merged",
        description="How LoRA adapter updates are applied (with trainer.lora): merged into the weights "
        "(W = W0 + scaling * B @ A per version, from a kept copy of the targeted base weights; decoding costs "
        "what the base model costs) or live (peft's LoRA layers in the model, the adapter's tensors loaded into "
        "them; no copy of the base weights, a little more work per token).",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="Set torch's CPU intra-op threads at start, and decode with them; unset: the count the "
        "process's calling thread has at start (torch's default, or what a trainer whose CPU ranks share this host "
        "left to this process: the fsdp engine's cpu_threads_per_rank).",
    )
    share_contexts: bool = Field(
        True,
        description="Decode sequences whose prompt and tokens so far are identical (the n samples of a prompt, "
        "until their tokens differ) as one row of the batch, each still sampling its own token from that row's "
        "logits; off: one row per sequence (after a shared prefill). The same tokens and log-probs either way, "
        "to float rounding.",
    )
    weight_load: Literal["view", "copy"] = Field(
        "view",
        description="How a full weight update is loaded: view makes each model tensor a view of the received "
        "bucket where device, dtype and shape match (no copy; the engine then holds that version's buffers "
        "until the next update), copy copies into the model's own tensors. Adapter updates always copy.",
    )

    def accepts_weights(self, model: ModelConfig, weights: Mapping[str, Sequence[int]]) -> None:
        """``ValueError`` unless ``weights`` fit ``model``'s ``state_dict`` (names, shapes, full coverage).

        The config-time twin of the checks ``update_weights`` runs on every
        update, on the model built on the meta device: no weights are loaded.
        """
        from asyncflow_core.config.hf import meta_tensors
        from asyncflow_core.config.pairing import check_against

        check_against(ModelTensors.of(meta_tensors(model)), weights)


@dataclass(eq=False)
class _Call:
    """One ``generate`` call: where its results are delivered."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(eq=False)
class _Seq:
    """One request's state. Tokens include a resumed prefix; the last token is not yet in the KV cache."""

    request: GenerationRequest
    call: _Call
    stop: frozenset[int]
    generator: torch.Generator | None
    held: bool  #: submitted while pausing: not admitted before resume()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    abort: bool = False  #: abort() asked for it
    dropped: bool = False  #: its generate() iterator went away; nobody wants the result
    done: bool = False
    #: most tokens (prefix included) before it ends with reason length: max_new_tokens, or the model's context
    limit: int = 0
    #: (temperature, top_p, top_k): rows with the same key are sampled together
    sampling_key: tuple[float, float, int] = (1.0, 1.0, -1)


@dataclass(eq=False)
class _Batch:
    """The running sequences and their right-aligned KV cache.

    The cache has one row per distinct context (``share_contexts``): sequences whose prompt and tokens are the
    same (the n samples of a prompt, until their tokens differ) share a cache row, decoded once per step.
    ``slot[i]`` is the cache row of ``seqs[i]``; without sharing ``slot[i] == i``.
    """

    seqs: list[_Seq]
    slot: list[int]  #: cache row of each sequence
    kv: list[tuple[torch.Tensor, torch.Tensor]]  #: per layer, [cache rows, kv_heads, columns, head_dim]
    mask: torch.Tensor  #: [cache rows, columns] int64, 1 where a column holds a real token
    positions: torch.Tensor  #: [cache rows] int64, position id of each row's next (pending) token
    #: [cache rows] int64, the token each row feeds to the next decoding step; None right after a forward
    #: (the sampled tokens, not yet chosen, become it)
    pending: torch.Tensor | None


class TorchRolloutEngine(RolloutEngine):
    """A Hugging Face causal LM behind the RolloutEngine contract (see the module docstring)."""

    def __init__(self, config: TorchRolloutConfig) -> None:
        if config.model is None:
            raise ConfigError(
                "the torch rollout engine needs a model: set the run's `model` section (path or hf_config) "
                "or rollout.options.model"
            )
        self.config = config
        self.model_config: ModelConfig = config.model
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"rollout device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
        self.device = torch.device(device)
        self._net: torch.nn.Module | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._vocab = 0
        self._max_positions: int | None = None
        self._eos: frozenset[int] = frozenset()
        self._keep_logits_arg = False
        self._cache_arg = "past_key_values"
        self._version = 0
        self._gen: torch.Generator | None = None
        self._active: dict[str, _Seq] = {}
        self._waiting: list[_Seq] = []
        self._batch: _Batch | None = None
        self._lock = asyncio.Lock()  # held for a decoding step or a weight swap: the safe point
        self._work = asyncio.Event()
        self._changed = asyncio.Event()
        self._holding = False  # pause() in progress or paused: new requests are held
        self._reap_due = False  # a sequence was aborted or dropped since the last _reap
        self._paused = False  # no decoding step runs
        self._scheduler: asyncio.Task | None = None
        self._failure: EngineError | None = None
        self._threads = torch.get_num_threads()  #: intra-op threads the decoding thread uses (set again at start)
        self._shut = False
        self._lora: LoraSpec | None = None
        self._adapter: _Adapter | None = None
        self._loader: WeightLoader | None = None

    # -- lifecycle ----------------------------------------------------------

    @property
    def features(self) -> RolloutFeatures:
        return FEATURES

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        from asyncflow_plugins.hf.model import build_causal_lm

        if self._net is not None:
            return
        if self.config.torch_threads is not None:
            torch.set_num_threads(self.config.torch_threads)
        # the count the decoding thread keeps to: with OpenMP, torch's thread count is per thread once a thread has
        # computed, so a worker thread would otherwise keep whatever it had (a trainer whose CPU ranks share this
        # host lowers the calling thread's count before the engine starts: fsdp's _share_cpu)
        self._threads = torch.get_num_threads()
        try:
            net = await asyncio.to_thread(
                build_causal_lm, self.model_config, seed=self.config.init_seed, device=self.device
            )
        except (ConfigError, EngineError):
            raise
        except Exception as exc:  # noqa: BLE001 - any loader failure is reported with its reason
            raise EngineError(f"could not load the model ({type(exc).__name__}: {exc})") from exc
        cfg = net.config
        self._vocab = int(net.get_output_embeddings().weight.shape[0])
        positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        self._max_positions = int(positions) if positions else None
        self._eos = self._eos_ids()
        forward_args = inspect.signature(net.forward).parameters
        self._keep_logits_arg = "logits_to_keep" in forward_args
        # transformers 5.x names the key/value cache ``cache`` (``past_key_values`` is deprecated and goes in 5.40);
        # 4.x knows only ``past_key_values``
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._params = dict(net.state_dict(keep_vars=True))
        self._loader = WeightLoader(self._params, views=self.config.weight_load == "view")
        self._gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        if self._lora is not None:
            self._adapter = await asyncio.to_thread(_Adapter.build, net, self._params, self._lora,
                                                    self.config.lora_mode == "live")
        self._net = net
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule(), name="torch-rollout-scheduler")

    def configure_adapter(self, spec: LoraSpec) -> None:
        if self._lora is not None:
            if spec == self._lora:
                return
            raise ConfigError("configure_adapter was already called on this torch rollout engine with another "
                              "LoRA spec; an engine serves one adapter shape")
        if self._net is not None:
            if self._version != 0 or self._adapter is not None:
                raise ConfigError("configure_adapter must come before the first weight update of the torch engine")
            self._adapter = _Adapter.build(self._net, self._params, spec, self.config.lora_mode == "live")
        self._lora = spec

    @property
    def adapter_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The adapter tensors an adapter-only update carries (peft's names), with shape and dtype; {} without LoRA."""
        return {} if self._adapter is None else dict(self._adapter.specs)

    def _eos_ids(self) -> frozenset[int]:
        explicit = self.config.eos_token_ids
        bad = [t for t in explicit if not 0 <= t < self._vocab]
        if bad:
            raise ConfigError(f"eos_token_ids {bad} are outside the model's vocabulary [0, {self._vocab})")
        return frozenset(explicit)

    def _check_started(self) -> torch.nn.Module:
        if self._shut:
            raise EngineError("the torch rollout engine was shut down")
        if self._failure is not None:
            raise self._failure
        if self._net is None:
            raise EngineError("call start() before using the torch rollout engine")
        return self._net

    async def health(self) -> Health:
        if self._shut:
            return Health(ok=False, detail="shut down")
        if self._failure is not None:
            return Health(ok=False, detail=str(self._failure))
        if self._net is None:
            return Health(ok=False, detail="not started")
        return Health(ok=True, detail="paused" if self._paused else "", in_flight=len(self._active))

    async def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True  # refuse new work; the scheduler runs on until the aborted requests are handed back
        if self._net is not None:
            await self.abort(None)
            await self._wait_for(lambda: not self._active)
        self._work.set()
        if self._scheduler is not None:
            await asyncio.gather(self._scheduler, return_exceptions=True)
            self._scheduler = None
        self._batch = None
        self._net = None
        self._params = {}
        self._loader = None  # with its views: a version's buffers (an arena slot, a shm mapping and its lock) go
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- generate -------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        self._check_started()
        requests = list(requests)
        ids = [r.request_id for r in requests]
        seen: set[str] = set()
        dupes = {i for i in ids if i in seen or seen.add(i)} | (seen & self._active.keys())
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {sorted(dupes)}")
        call = _Call()
        mine: list[_Seq] = []
        for r in requests:
            seq = _Seq(
                request=r,
                call=call,
                stop=self._eos | frozenset(r.sampling.stop_token_ids),
                generator=None
                if r.sampling.seed is None
                else torch.Generator(device=self.device).manual_seed(r.sampling.seed),
                held=self._holding,
                tokens=list(r.prefix_token_ids),
                logprobs=list(r.prefix_logprobs),
                versions=list(r.prefix_versions),
                limit=r.sampling.max_new_tokens if self._max_positions is None
                else min(r.sampling.max_new_tokens, self._max_positions - len(r.prompt_token_ids)),
                sampling_key=(r.sampling.temperature, r.sampling.top_p, r.sampling.top_k),
            )
            problem = self._invalid(r)
            if problem is not None:
                seq.done = True
                call.queue.put_nowait(_result(seq, FinishReason.ERROR, problem))
                continue
            self._active[r.request_id] = seq
            mine.append(seq)
            # a resumed prefix may already be complete
            if seq.tokens and seq.tokens[-1] in seq.stop:
                self._finish(seq, FinishReason.STOP)
            elif len(seq.tokens) >= r.sampling.max_new_tokens:
                self._finish(seq, FinishReason.LENGTH)
            else:
                self._waiting.append(seq)
        self._work.set()
        remaining = len(requests)
        try:
            while remaining:
                item = await call.queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= 1
                yield item
        finally:
            # the consumer left early (or an error ends the stream): the scheduler drops these rows
            for seq in mine:
                if not seq.done:
                    seq.dropped = True
                    self._reap_due = True
                    if self._active.get(seq.request.request_id) is seq:
                        del self._active[seq.request.request_id]
            self._work.set()

    def _invalid(self, r: GenerationRequest) -> str | None:
        """Why a request cannot be served (reported as its ERROR result), or None."""
        ids = (r.prompt_token_ids, r.prefix_token_ids)
        if any(part and not (0 <= min(part) and max(part) < self._vocab) for part in ids):
            bad = [t for part in ids for t in part if not 0 <= t < self._vocab]
            return f"token ids outside the model's vocabulary [0, {self._vocab}): {bad[:5]}"
        context = len(r.prompt_token_ids) + len(r.prefix_token_ids)
        if self._max_positions is not None and context >= self._max_positions:
            return (
                f"prompt + prefix is {context} tokens; the model takes at most {self._max_positions} positions "
                "(max_position_embeddings), leaving no room to generate"
            )
        return None

    # -- abort / pause ----------------------------------------------------------

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        if request_ids is None:
            targets = [rid for rid, s in self._active.items() if not s.abort]
        else:
            targets = [rid for rid in dict.fromkeys(request_ids) if rid in self._active and not self._active[rid].abort]
        for rid in targets:
            self._active[rid].abort = True
        if targets:
            self._reap_due = True
            self._work.set()
        return targets

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._check_started()
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"unknown pause mode {mode!r}; use one of {[m.value for m in PauseMode]}") from None
        self._holding = True
        if mode is PauseMode.KEEP:
            self._paused = True  # the worker stops at its next step boundary (_steps)
            async with self._lock:  # a step in progress finishes; none starts after it
                pass
            return
        if mode is PauseMode.ABORT:
            await self.abort([rid for rid, s in self._active.items() if not s.held])
        await self._wait_for(lambda: all(s.held for s in self._active.values()))
        self._paused = True

    async def resume(self) -> None:
        if not self._holding and not self._paused:
            return
        self._holding = False
        self._paused = False
        for seq in self._waiting:
            seq.held = False
        for seq in self._active.values():
            seq.held = False
        self._work.set()

    async def sleep(self, level: int = 1) -> None:
        raise UnsupportedFeatureError("the torch rollout engine does not release device memory (supports_sleep=False)")

    async def wake_up(self) -> None:
        raise UnsupportedFeatureError("the torch rollout engine does not release device memory (supports_sleep=False)")

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            if self._failure is not None or self._scheduler is None or self._scheduler.done():
                return
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- weights ------------------------------------------------------------

    async def update_weights(
        self, version: int, buckets: AsyncIterable[WeightBucket], *, kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE
    ) -> None:
        self._check_started()
        try:
            kv_cache = KVCachePolicy(kv_cache)
        except ValueError:
            choices = [p.value for p in KVCachePolicy]
            raise ValueError(f"unknown kv_cache policy {kv_cache!r}; use one of {choices}") from None
        received = await self._receive(version, buckets)
        # the swap runs to the end even if the caller is cancelled: weights and version never disagree
        await asyncio.shield(asyncio.ensure_future(self._install(version, received, kv_cache)))

    async def _receive(self, version: int, buckets: AsyncIterable[WeightBucket]) -> dict[str, torch.Tensor]:
        """Every tensor of the update, checked against the model (tied weights count under any name); none applied.

        With an adapter configured, an update whose names are all adapter names is an adapter-only update
        (every adapter tensor must arrive); one that carries base names too must cover the whole base model,
        and then either all of the adapter or none of it.
        """
        base = ModelTensors.of(self._params)
        if self._adapter is None:
            checked = await collect_update(version, buckets, model=base)
            return {name: tensor for bucket in checked for name, tensor in bucket.tensors()}
        received = [b async for b in buckets]
        names = {m.name for b in received for m in b.metas}
        adapter = self._adapter.model_tensors(received)
        if names and names <= set(adapter.specs):
            checked = await collect_update(version, _replay(received), model=adapter, partial=list(adapter.specs))
        elif names & set(adapter.specs):
            both = ModelTensors({**base.specs, **adapter.specs}, base.tied_groups)
            checked = await collect_update(version, _replay(received), model=both)
        else:
            checked = await collect_update(version, _replay(received), model=base)
        return {name: tensor for bucket in checked for name, tensor in bucket.tensors()}

    async def _install(self, version: int, received: dict[str, torch.Tensor], kv_cache: KVCachePolicy) -> None:
        self._work.set()  # a worker decoding on (_steps) hands the batch back at its next step boundary
        async with self._lock:
            try:
                if self._adapter is None:
                    await asyncio.to_thread(self._copy_weights, received)
                else:
                    await asyncio.to_thread(self._adapter.apply, received)
            except LoadInterrupted as exc:  # the model is half old, half new: serve nothing more from it
                self._fail(EngineError(f"weight version {version}: {exc}; restart the engine"))
                raise
            self._version = version
            if kv_cache is KVCachePolicy.RECOMPUTE and self._batch is not None:
                # held sequences re-prefill their whole context with the new weights before the next token
                self._waiting[:0] = self._batch.seqs
                self._batch = None
        self._work.set()

    @torch.no_grad()
    def _copy_weights(self, received: dict[str, torch.Tensor]) -> None:
        # the received tensors are views of the verified buckets: the model takes them as its tensors (views: the
        # engine then holds this version's buffers, which their sender does not rewrite while held), or they are
        # copied in 8 MiB spans on the digest threads (copy_tensors; docs/performance.md, "Weight sync")
        assert self._loader is not None
        self._loader.load(received.items())

    # -- the scheduler ---------------------------------------------------------

    async def _schedule(self) -> None:
        """Reap aborted rows, admit waiting ones, decode one step; repeat while there is work."""
        try:
            while True:
                if self._shut and not self._active:
                    return
                if not self._has_work():
                    self._work.clear()
                    self._notify()
                    await self._work.wait()
                    continue
                async with self._lock:
                    self._reap()
                    admit = self._admissible()
                    decode = self._batch is not None and not self._paused
                    finished: list[tuple[_Seq, FinishReason]] = []
                    if admit or decode:
                        # cleared here, set by whatever wants in (new requests, abort, pause, a weight swap, a
                        # consumer leaving): the worker then hands the batch back after its current step
                        self._work.clear()
                        loop = asyncio.get_running_loop()
                        finished = await asyncio.to_thread(self._steps, admit, decode, self._version,
                                                           lambda done: loop.call_soon_threadsafe(self._deliver, done))
                self._deliver(finished)
                await asyncio.sleep(0)  # let abort / pause / update_weights / new requests in
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - an engine-wide failure ends every stream with the reason
            self._fail(exc)

    def _deliver(self, finished: list[tuple[_Seq, FinishReason]]) -> None:
        """Hand finished sequences to their ``generate`` calls (event loop thread)."""
        for seq, reason in finished:
            self._finish(seq, reason)
        self._notify()

    def _has_work(self) -> bool:
        if self._reap_due:
            return True
        if self._paused:
            return False
        return self._batch is not None or any(not s.held for s in self._waiting)

    def _admissible(self) -> list[_Seq]:
        if self._paused:
            return []
        room = self.config.max_batch - (len(self._batch.seqs) if self._batch is not None else 0)
        admit = [s for s in self._waiting if not s.held][: max(room, 0)]
        if admit:
            chosen = set(map(id, admit))
            self._waiting = [s for s in self._waiting if id(s) not in chosen]
        return admit

    def _reap(self) -> None:
        """Finish aborted sequences (partial results) and forget dropped ones."""
        if not self._reap_due:
            return
        self._reap_due = False
        keep = []
        for seq in self._waiting:
            if seq.abort or seq.dropped:
                self._finish(seq, FinishReason.ABORT)
            else:
                keep.append(seq)
        self._waiting = keep
        if self._batch is not None:
            batch = self._batch
            rows = [i for i, s in enumerate(batch.seqs) if not (s.abort or s.dropped)]
            if len(rows) < len(batch.seqs):
                for s in batch.seqs:
                    if s.abort or s.dropped:
                        self._finish(s, FinishReason.ABORT)
                first: dict[int, int] = {}  # the cache rows still used, in order
                slot = [first.setdefault(batch.slot[i], len(first)) for i in rows]
                self._batch = _take(batch, [batch.seqs[i] for i in rows], slot, list(first), None) if rows else None

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        if seq.done:
            return
        seq.done = True
        rid = seq.request.request_id
        if self._active.get(rid) is seq:
            del self._active[rid]
        if not seq.dropped:
            seq.call.queue.put_nowait(_result(seq, reason))

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, EngineError):
            error = exc
        else:
            error = EngineError(f"the torch rollout engine failed during a decoding step ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
        self._failure = error
        calls = {id(s.call): s.call for s in (*self._active.values(), *self._waiting)}
        for call in calls.values():
            call.queue.put_nowait(error)
        for seq in self._active.values():
            seq.done = True
        self._active.clear()
        self._waiting = []
        self._batch = None
        self._notify()

    # -- decoding steps (worker thread) ----------------------------------------

    def _steps(self, admit: list[_Seq], decode: bool, version: int,
               deliver: Callable[[list[tuple[_Seq, FinishReason]]], None]) -> list[tuple[_Seq, FinishReason]]:
        """One step, then more decoding steps of the running batch while the event loop side wants nothing.

        Each return to the event loop costs a thread hand-off and waits for the loop to be free; in a run the
        loop is busy with the flow's stages, and a batch of short completions is a few steps. So the worker
        decodes on until a step boundary where something wants in (``_work`` set: new requests, an abort,
        a pause, a weight swap, a consumer leaving), the batch is empty, or :data:`_STEPS_PER_CALL` steps
        ran. Sequences finished on the way are delivered at once (``deliver``, thread-safe); the last
        step's are returned. The lock stays held throughout, so a step boundary is still the safe point.
        """
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        finished = self._step(admit, decode, version)
        for _ in range(_STEPS_PER_CALL - 1):
            if self._batch is None or self._work.is_set() or self._paused:
                break
            if finished:
                deliver(finished)
            finished = self._step([], True, version)
        return finished

    @torch.no_grad()
    def _step(self, admit: list[_Seq], decode: bool, version: int) -> list[tuple[_Seq, FinishReason]]:
        """Decode the running rows, prefill the admitted ones, sample one token for each; prune finished rows."""
        parts: list[tuple[_Batch, torch.Tensor]] = []
        if decode and self._batch is not None:
            parts.append(self._decode(self._batch))
        if admit:
            parts.append(self._prefill(admit))
        batch = parts[0][0] if len(parts) == 1 else _merge(parts[0][0], parts[1][0])
        logits = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        if logits.shape[0] < len(batch.seqs):  # shared cache rows: each sequence samples from its row's logits
            logits = logits.index_select(0, torch.tensor(batch.slot, device=logits.device))
        tokens, logprobs = self._sample(batch.seqs, logits)
        finished: list[tuple[_Seq, FinishReason]] = []
        keep = []
        for i, (seq, tok, lp) in enumerate(zip(batch.seqs, tokens, logprobs, strict=True)):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            if tok in seq.stop:
                finished.append((seq, FinishReason.STOP))
            elif len(seq.tokens) >= seq.limit:  # max_new_tokens, or the model has no position left
                finished.append((seq, FinishReason.LENGTH))
            else:
                keep.append(i)
        self._batch = self._next_batch(batch, keep, tokens) if keep else None
        return finished

    def _next_batch(self, batch: _Batch, keep: list[int], tokens: list[int]) -> _Batch:
        """The batch of the rows ``keep`` for the next step, each fed its sampled token.

        Sequences of one cache row that sampled the same token still share their whole context: with
        ``share_contexts`` they share the next step's row too (a row per distinct (row, token)); without, every
        sequence gets a row of its own (the cache rows of a shared prefill are copied).
        """
        slot = batch.slot
        if self.config.share_contexts:
            first: dict[tuple[int, int], int] = {}
            rows = [first.setdefault((slot[i], tokens[i]), len(first)) for i in keep]
            parents = [row for row, _ in first]
            pending = [tok for _, tok in first]
        else:
            rows = list(range(len(keep)))
            parents = [slot[i] for i in keep]
            pending = [tokens[i] for i in keep]
        fed = torch.tensor(pending, dtype=torch.long, device=batch.mask.device)
        return _take(batch, [batch.seqs[i] for i in keep], rows, parents, fed)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Last-position logits (float32) and the updated per-layer key/value tensors."""
        assert self._net is not None
        extra = {"logits_to_keep": 1} if self._keep_logits_arg else {}
        extra[self._cache_arg] = cache
        out = self._net(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        return out.logits[:, -1].float(), _cache_tensors(getattr(out, self._cache_arg))

    def _decode(self, batch: _Batch) -> tuple[_Batch, torch.Tensor]:
        from transformers import DynamicCache

        assert batch.pending is not None
        mask = torch.cat([batch.mask, batch.mask.new_ones(batch.mask.shape[0], 1)], dim=1)
        cache = DynamicCache(batch.kv)
        logits, kv = self._forward(batch.pending.unsqueeze(1), mask, batch.positions.unsqueeze(1), cache)
        return _Batch(batch.seqs, batch.slot, kv, mask, batch.positions + 1, None), logits

    def _prefill(self, seqs: list[_Seq]) -> tuple[_Batch, torch.Tensor]:
        from transformers import DynamicCache

        # tuple() of a tuple is the tuple itself: no copy for a fresh request's prompt
        contexts = [(*s.request.prompt_token_ids, *s.tokens) if s.tokens else tuple(s.request.prompt_token_ids)
                    for s in seqs]
        # the n samples of a prompt share their context: prefill each distinct context once, as one cache row of
        # them all (a GRPO step's prefill runs 1/n of the rows; _next_batch splits a row where their tokens differ)
        first: dict[tuple[int, ...], int] = {}
        slot = [first.setdefault(ctx, len(first)) for ctx in contexts]
        unique = list(first)
        width = max(map(len, unique))
        # left padding: every row ends in the last column
        ids = torch.tensor([(0,) * (width - len(ctx)) + ctx for ctx in unique], dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(ctx)) + [1] * len(ctx) for ctx in unique], dtype=torch.long,
                            device=self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits, kv = self._forward(ids, mask, positions, DynamicCache())
        # the pending token of a prefilled row is the one sampled now, at position len(context)
        return _Batch(list(seqs), slot, kv, mask, mask.sum(dim=1), None), logits

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token per row from its sampling distribution, and that token's log-prob under it."""
        key = seqs[0].sampling_key
        if all(s.sampling_key == key and s.generator is None for s in seqs):
            # the common case, one group drawing from the engine's generator: what the loop below does for it
            logp = sampling_logprobs(logits, *key)
            drawn = torch.multinomial(logp.exp(), 1, generator=self._gen)
            return drawn.squeeze(1).tolist(), logp.gather(1, drawn).squeeze(1).tolist()
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        picked = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        groups: dict[tuple[float, float, int], list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(s.sampling_key, []).append(i)
        for (temperature, top_p, top_k), rows in groups.items():
            index = torch.tensor(rows, device=logits.device)
            logp = sampling_logprobs(logits[index], temperature, top_p, top_k)
            probs = logp.exp()
            shared = [j for j, r in enumerate(rows) if seqs[r].generator is None]
            drawn = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if shared:
                sel = torch.tensor(shared, device=logits.device)
                drawn[sel] = torch.multinomial(probs[sel], 1, generator=self._gen).squeeze(1)
            for j, r in enumerate(rows):
                if seqs[r].generator is not None:  # a request with its own seed draws from its own generator
                    drawn[j] = torch.multinomial(probs[j], 1, generator=seqs[r].generator)[0]
            tokens[index] = drawn
            picked[index] = logp.gather(1, drawn.unsqueeze(1)).squeeze(1)
        return tokens.tolist(), picked.tolist()


async def _replay(buckets: list[WeightBucket]) -> AsyncIterator[WeightBucket]:
    for bucket in buckets:
        yield bucket


_PEFT_PREFIX = "base_model.model."


class _Adapter:
    """A LoRA adapter on the engine's model: what an update carries, and how a version is put in force.

    ``layers``: per targeted module, its base weight's name, the peft names of its A and B, peft's scaling and
    whether the base stores its weight transposed (``fan_in_fan_out``, GPT-2's Conv1D). ``saved``: peft name of
    a ``modules_to_save`` tensor -> the base tensor it replaces. Merged mode keeps ``base``: a copy of every
    base tensor an adapter overwrites (``W0``), the only state a version is computed from.
    """

    def __init__(self, specs, layers, saved, params, peft_model) -> None:
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = specs
        self.layers: list[tuple[str, str, str, float, bool]] = layers
        self.saved: dict[str, str] = saved
        self.params = params
        self.peft_model = peft_model  #: live mode: the model with peft's layers injected; None when merged
        #: live mode: exported name -> the peft parameter it loads into (None: leave it to set_peft_model_state_dict)
        self.slots: dict[str, torch.Tensor] | None = None
        if peft_model is not None:
            named = dict(peft_model.named_parameters())
            slots = {}
            for name in specs:
                stem, _, leaf = name.rpartition(".")
                if name in saved:
                    inner = f"{stem}.modules_to_save.default.{leaf}"
                else:
                    inner = f"{stem}.default.{leaf}"  # ...q_proj.lora_A.weight -> ...q_proj.lora_A.default.weight
                if inner not in named:
                    break
                slots[name] = named[inner]
            else:
                self.slots = slots
        touched = [w for w, *_ in layers] + list(saved.values())
        self.base: dict[str, torch.Tensor] = (
            {} if peft_model is not None else {name: params[name].detach().clone() for name in touched}
        )

    @classmethod
    def build(cls, net: torch.nn.Module, params: dict[str, torch.Tensor], spec: LoraSpec, live: bool) -> _Adapter:
        from asyncflow_core.types.adapter import adapter_state_dict, wrap

        spec.peft_config()  # ConfigError in one line when peft is missing
        import peft

        try:
            if live:
                model = wrap(net, spec)  # injects peft's layers into net itself
                net.eval()  # the new layers start in training mode: no dropout when sampling
            else:
                import transformers

                with torch.device("meta"):  # only the layout: names, shapes, scalings
                    shadow = transformers.AutoModelForCausalLM.from_config(net.config, dtype=net.dtype)
                model = wrap(shadow, spec)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        state = adapter_state_dict(model)
        specs = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
        layers = []
        for path, module in model.named_modules():
            if not isinstance(module, peft.tuners.lora.LoraLayer) or "default" not in getattr(module, "lora_A", {}):
                continue
            inner = path.removeprefix(_PEFT_PREFIX)
            a, b = f"{path}.lora_A.weight", f"{path}.lora_B.weight"
            if a not in specs or b not in specs:
                raise ConfigError(f"peft names the adapter of {inner} differently than expected ({a})")
            weight = f"{inner}.weight"
            if weight not in params:
                raise ConfigError(f"LoRA targets {inner}, whose weight {weight} is not a tensor of the model")
            transposed = bool(getattr(module, "fan_in_fan_out", False))
            layers.append((weight, a, b, float(module.scaling["default"]), transposed))
        lora_names = {n for _, a, b, _, _ in layers for n in (a, b)}
        saved = {}
        for name in specs:
            if name in lora_names:
                continue
            target = name.removeprefix(_PEFT_PREFIX)
            if target not in params:
                raise ConfigError(f"the adapter tensor {name} has no base tensor {target} in the model")
            saved[name] = target
        if not layers and not saved:
            raise ConfigError(f"the LoRA spec targets no module of this model ({spec.target_modules})")
        return cls(specs, layers, saved, params, model if live else None)

    def model_tensors(self, received: Sequence[WeightBucket]) -> ModelTensors:
        """The adapter's tensors for checking an update: names and shapes are the adapter's; a floating dtype
        is taken as sent (the trainer may keep its adapter in float32 on a bfloat16 base), cast when applied."""
        sent = {m.name: m.dtype for b in received for m in b.metas}
        specs = {}
        for name, (shape, dtype) in self.specs.items():
            got = sent.get(name)
            if got is not None and dtype.is_floating_point and dtype_from_name(got).is_floating_point:
                dtype = dtype_from_name(got)
            specs[name] = (shape, dtype)
        return ModelTensors(specs)

    @torch.no_grad()
    def apply(self, received: dict[str, torch.Tensor]) -> None:
        """Put one version in force: base tensors sent (a full update) replace W0; then the adapter sent, or none."""
        adapter = {n: t for n, t in received.items() if n in self.specs}
        for name, tensor in received.items():
            if name in self.specs:
                continue
            self.params[name].copy_(tensor)
            if name in self.base:
                self.base[name].copy_(tensor)
        if self.peft_model is not None:
            self._load_live(adapter or self._zero())
            return
        for weight, a, b, scaling, transposed in self.layers:
            w0, w = self.base[weight], self.params[weight]
            if not adapter:
                w.copy_(w0)
                continue
            lo = adapter[b].to(device=w0.device, dtype=torch.float32)  # [out, r]
            hi = adapter[a].to(device=w0.device, dtype=torch.float32)  # [r, in]
            if transposed:  # the base stores [in, out]
                lo, hi = hi.T, lo.T
            if w.dtype == torch.float32:
                torch.addmm(w0, lo, hi, alpha=scaling, out=w)  # W = W0 + scaling * B @ A in one pass
            else:  # float32 arithmetic, one rounding to the model's dtype
                w.copy_(torch.addmm(w0.float(), lo, hi, alpha=scaling))
        for name, target in self.saved.items():
            self.params[target].copy_(adapter[name] if adapter else self.base[target])

    def _zero(self) -> dict[str, torch.Tensor]:
        """The adapter that changes nothing: B = 0 (A kept), modules_to_save equal to their base."""
        from asyncflow_core.types.adapter import adapter_state_dict

        state = adapter_state_dict(self.peft_model)
        out = {}
        for name, tensor in state.items():
            if name in self.saved:
                out[name] = self.params[self.saved[name]]
            elif name.endswith("lora_B.weight"):
                out[name] = torch.zeros_like(tensor)
            else:
                out[name] = tensor
        return out

    def _load_live(self, adapter: dict[str, torch.Tensor]) -> None:
        if self.slots is not None:
            for name, tensor in adapter.items():
                self.slots[name].copy_(tensor)
            return
        import peft

        result = peft.set_peft_model_state_dict(self.peft_model, adapter)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise EngineError(f"peft did not take adapter tensors {unexpected[:3]} into the model")


def _result(seq: _Seq, reason: FinishReason, error: str | None = None) -> GenerationResult:
    r = seq.request
    versions = seq.versions
    return with_version_range(GenerationResult(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        token_ids=tuple(seq.tokens),
        logprobs=tuple(seq.logprobs),
        versions=tuple(seq.versions),
        finish_reason=reason,
        error=error,
        metadata=r.metadata,
    ), min(versions, default=None), max(versions, default=None))


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer key/value tensors of a ``DynamicCache`` (refusing cache types this engine cannot re-batch)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        raise EngineError(
            f"the model returned a {type(cache).__name__} without plain per-layer key/value tensors; the torch "
            "engine supports decoder-only models with a standard DynamicCache"
        )
    return [(layer.keys, layer.values) for layer in layers]


def _take(batch: _Batch, seqs: list[_Seq], slot: list[int], parents: list[int], pending: torch.Tensor | None) -> _Batch:
    """A batch of ``seqs`` (``slot``: each one's new cache row) whose cache row ``j`` is ``batch``'s row
    ``parents[j]``, fed ``pending`` (None: the parents' pending tokens); leading columns no row uses are dropped."""
    if pending is None and batch.pending is not None:
        pending = batch.pending if parents == list(range(len(batch.pending))) else batch.pending[parents]
    if parents == list(range(batch.mask.shape[0])):
        return _Batch(seqs, slot, batch.kv, batch.mask, batch.positions, pending)
    index = torch.tensor(parents, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    kv = [(k[:, :, start:].index_select(0, index), v[:, :, start:].index_select(0, index)) for k, v in batch.kv]
    return _Batch(seqs, slot, kv, mask[:, start:], batch.positions.index_select(0, index), pending)


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """Stack two batches, padding the one with fewer cache slots on the left (rows stay right-aligned)."""
    width = max(a.mask.shape[1], b.mask.shape[1])

    def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - t.shape[dim]
        if not missing:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    kv = [
        (torch.cat([pad(ka, 2), pad(kb, 2)]), torch.cat([pad(va, 2), pad(vb, 2)]))
        for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True)
    ]
    rows = a.mask.shape[0]
    return _Batch(
        a.seqs + b.seqs, a.slot + [rows + i for i in b.slot], kv, torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
        torch.cat([a.positions, b.positions]), None,
    )
