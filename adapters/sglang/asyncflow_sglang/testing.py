"""A protocol fake of the SGLang HTTP server, for tests on machines without a GPU. It is NOT SGLang.

SGLang has no CPU build, so the adapter's tests run against this small HTTP
server instead. It answers the routes the adapter uses with the request and
response shapes of SGLang 0.5.23 (``http_server.py``, ``io_struct.py``) and,
written here from reading SGLang's source, the behaviour the adapter depends
on -- as strict as the real server, never more lenient:

- ``/generate``: the body contract (``sampling_params`` keys and types;
  an unknown key is a 400), the sampling checks (``verify``), duplicate rids;
  a request is known to the "tokenizer manager" as soon as it arrives, then
  waits out a pause (and an update holding the model-update lock) before it
  reaches the "scheduler". Temperatures below 1e-6 become greedy;
  ``sampling_seed`` is honoured only with ``--enable-deterministic-inference``;
  the model's EOS (``--eos-token-id``) ends a completion like a stop id;
  top-k / top-p are cut the way SGLang's PyTorch sampler cuts them (top-p on
  the untruncated distribution); ``return_sampling_mask`` returns the sampled
  token's renormalised log-prob and refuses a top_k outside (1,
  ``--sampling-mask-max-tokens``]; answers carry ``weight_versions`` spans.
- ``/abort_request``: an abort for a rid the server does not know yet is
  dropped, a rid is aborted once (later aborts of it are ignored, even when
  the first one found nothing to abort), a rid aborts every request whose rid
  starts with it, ``abort_all`` always goes through.
- ``/pause_generation`` (abort / in_place / retract), ``/continue_generation``.
- weights: ``/init_weights_update_group`` joins through this module's own
  rendering of SGLang's ``init_custom_process_group`` rendezvous
  (:func:`sglang_join`); from 0.5.21 on ``/update_weights_from_distributed``
  and ``/update_weights_from_tensor`` are refused outside a
  ``/begin_weight_update`` ... ``/end_weight_update`` session (before any
  receive is posted); ``dp_size > 1`` fails the group's routes with a 500.
  ``/update_weights_from_tensor`` cannot map CUDA IPC handles here: inside a
  session it answers 400.
- memory: ``/release_memory_occupation`` on a busy server, or
  ``/resume_memory_occupation`` of a tag never released (``null`` names them
  all), kills the server, as SGLang's scheduler does (an exception there
  SIGQUITs the launcher).
- ``/health`` generates: it takes ``--health-delay-s`` (SGLang: 1 s at
  least), answers 503 after ``--health-timeout-s`` (SGLang: 20 s) while the
  server is paused or updating, and while it runs it is a request, so
  ``/flush_cache`` answers 400. ``/ready`` is 503 while paused.
- ``--api-key`` / ``--admin-api-key`` the way SGLang's middleware decides.
- ``/server_info`` reports ``--version`` (default 0.5.23).
- HTTP as SGLang's uvicorn serves it: keep-alive connections, an idle one
  closed after ``--timeout-keep-alive`` (SGLang's ``SGLANG_TIMEOUT_KEEP_ALIVE``,
  5 s), and a listen backlog of 2048 (uvicorn's), so a burst of new
  connections is queued, not reset.

The "model" is a toy bigram table: the logits of the next token are
``lm_head.weight[previous token] + lm_head.bias`` (or, with ``--model-kind
bigram``, ``bigram.weight[previous token]``, the ``toy`` trainer's table),
sampled one token per ``step_ms`` for every running request. The log-prob in
``output_token_logprobs`` is SGLang's default: ``log_softmax(logits /
temperature)`` at the sampled token, not renormalised after truncation.
Because sampling reads the weights, a test sees a weight update take effect.
What it does not model: tokenization and text, batching limits, KV-cache
memory, multiple ranks, streaming, and CUDA anything.

Fake-only routes for tests (no SGLang has them): ``POST /_fake/faults``
(``{"generate_status": 500, "generate_message": "...", "generate_delay_s": 3,
"unhealthy": true, "health_delay_s": 2, "times": 1}``; ``unhealthy`` makes ``/health`` and
``/model_info`` answer 503), ``GET /_fake/state`` and ``POST
/_fake/reset`` (``{"model_kind": "bigram", "vocab_size": 16, "seed": 0}`` switches the toy model).

Run it like ``launch_server``: ``python -m asyncflow_sglang.testing
--model-path toy --host 127.0.0.1 --port 30000`` (loopback only).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

#: What /server_info reports unless ``--version`` says otherwise
FAKE_VERSION = "0.5.23"

#: ``sampling_params`` keys of SGLang's API contract (``sglang/api/v1/api_types.py`` SamplingParams, "unknown
#: keys rejected") and the JSON type each must have
_NUMBER, _INT, _BOOL, _STR, _ANY = "f64", "i64", "a boolean", "a string", "any"
SAMPLING_KEYS = {
    "max_new_tokens": _INT, "stop": _ANY, "stop_token_ids": "ids", "stop_regex": _ANY, "temperature": _NUMBER,
    "top_p": _NUMBER, "top_k": _INT, "min_p": _NUMBER, "frequency_penalty": _NUMBER, "presence_penalty": _NUMBER,
    "repetition_penalty": _NUMBER, "min_new_tokens": _INT, "n": _INT, "json_schema": _STR, "regex": _STR,
    "ebnf": _STR, "structural_tag": _STR, "ignore_eos": _BOOL, "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL, "no_stop_trim": _BOOL, "stream_interval": _INT, "logit_bias": _ANY,
    "sampling_seed": _INT, "custom_params": _ANY, "beam_width": _INT, "watermark": _ANY, "choice": _ANY,
}
#: SGLang's ``_SAMPLING_EPS``: a lower temperature is greedy
GREEDY_BELOW = 1e-6
#: SGLang's ``GPU_MEMORY_ALL_TYPES``: what ``tags: null`` names
ALL_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
#: routes marked ADMIN_OPTIONAL in SGLang's http_server.py (the ones this fake serves)
ADMIN_ROUTES = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
    "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/update_weight_version", "/release_memory_occupation",
    "/resume_memory_occupation",
})


def toy_weights(vocab_size: int, seed: int, kind: str = "lm_head") -> dict[str, torch.Tensor]:
    """The fake's initial weights (tests rebuild them to score tokens independently).

    ``lm_head``: ``lm_head.weight`` [V, V] and ``lm_head.bias`` [V]. ``bigram``: the
    ``toy`` trainer's table (``bigram.weight``, same seed, same values), so a
    run can pair the ``toy`` trainer with this fake.
    """
    if kind == "bigram":
        from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table

        return {PARAM_NAME: initial_table(vocab_size, seed, 1.0)}
    gen = torch.Generator().manual_seed(seed)
    return {
        "lm_head.weight": torch.randn(vocab_size, vocab_size, generator=gen) * 2.0,
        "lm_head.bias": torch.zeros(vocab_size),
    }


def toy_logits(weights: dict[str, torch.Tensor], previous: int) -> torch.Tensor:
    if "lm_head.weight" in weights:
        return weights["lm_head.weight"][previous] + weights["lm_head.bias"]
    (table,) = weights.values()
    return table[previous]


def sglang_join(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                timeout_s: float) -> Any:
    """A server rank joining the weight-update group the way SGLang's ``init_custom_process_group`` does it
    (``utils/common.py``, 0.5.6 and 0.5.20 to 0.5.23; written here from reading it): rendezvous at
    ``init_method`` as ``rank``, the store wrapped in ``PrefixStore(group_name, store)``, then
    ``_new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name)``.

    This is the receiving side the adapter's rank 0 must meet; it shares no code with the adapter.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **options)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def weight_version_spans(events: list[tuple[str, int]], current: str, count: int) -> list[dict[str, Any]]:
    """``meta_info.weight_versions`` of a request: which weight version sampled which of its ``count`` tokens,
    from the (old version, tokens so far) recorded at each version change (SGLang's
    ``compute_weight_version_spans``, written here from reading it)."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, count)]:
        end = min(end, count)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class _Request:
    """One /generate request inside the fake."""

    def __init__(self, rid: str, input_ids: list[int], params: dict[str, Any], seed: int | None,
                 sampling_mask: bool) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.sampling_mask = sampling_mask
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.selected: list[float] = []  # renormalised log-probs (return_sampling_mask)
        self.events: list[tuple[str, int]] = []  # weight-version changes seen while it ran
        self.finish: dict[str, Any] | None = None
        self.abort_sent = False
        self.done = threading.Event()
        self.start = time.monotonic()


class _HTTPError(Exception):
    def __init__(self, status: int, payload: Any) -> None:
        super().__init__(str(payload))
        self.status = status
        self.payload = payload


def _error(status: int, message: str) -> _HTTPError:
    """SGLang's ``_create_error_response`` shape."""
    return _HTTPError(status, {"error": {"message": message}})


def _validation_error(message: str) -> _HTTPError:
    """SGLang's answer to a body that fails validation (its RequestValidationError handler)."""
    return _HTTPError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None,
                            "code": 400})


class _ServerDied(Exception):
    """SGLang's scheduler raised: it SIGQUITs the launcher and the whole server goes."""


def _check_contract(params: Any) -> None:
    """The API contract of ``sampling_params`` (SGLang answers its violations 400 ``{"error": text}``)."""
    if not isinstance(params, dict):
        raise _HTTPError(400, {"error": "invalid type: expected struct SamplingParams"})
    for key, value in params.items():
        kind = SAMPLING_KEYS.get(key)
        if kind is None:
            raise _HTTPError(400, {"error": f"unknown field `{key}`, expected one of "
                                            + ", ".join(f"`{k}`" for k in SAMPLING_KEYS)})
        if value is None or kind == _ANY:
            continue
        ok = {
            _NUMBER: isinstance(value, (int, float)) and not isinstance(value, bool),
            _INT: isinstance(value, int) and not isinstance(value, bool),
            _BOOL: isinstance(value, bool),
            _STR: isinstance(value, str),
            "ids": isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value),
        }[kind]
        if not ok:
            raise _HTTPError(400, {"error": f"invalid type: {value!r} for `{key}`, expected {kind}"})


def _verify(params: dict[str, Any]) -> None:
    """SGLang's ``SamplingParams.verify`` for the keys the fake samples with (a ValueError there is a 400)."""
    temperature = float(params.get("temperature", 1.0))
    if not math.isfinite(temperature) or temperature < 0:
        raise _error(400, f"temperature must be a non-negative finite number, got {temperature}.")
    top_p = float(params.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise _error(400, f"top_p must be in (0, 1], got {top_p}.")
    top_k = params.get("top_k", -1)
    if top_k is not None and top_k != -1 and top_k < 1:
        raise _error(400, f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if int(params.get("max_new_tokens", 128)) < 0:
        raise _error(400, f"max_new_tokens must be at least 0, got {params['max_new_tokens']}.")


class ProtocolFake:
    """The fake server's state: a "tokenizer manager" (known rids, the pause gate, the model-update lock) in
    front of a toy "scheduler" (one thread stepping every running request)."""

    def __init__(self, *, vocab_size: int = 32, seed: int = 0, step_ms: float = 2.0, model_path: str = "toy",
                 tp_size: int = 1, dp_size: int = 1, memory_saver: bool = False, api_key: str | None = None,
                 admin_api_key: str | None = None, model_kind: str = "lm_head", version: str = FAKE_VERSION,
                 deterministic: bool = False, sampling_mask_max_tokens: int = 4096, health_delay_s: float = 1.0,
                 health_timeout_s: float = 20.0, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.model_kind = model_kind
        self.seed = seed
        self.step_s = step_ms / 1000.0
        self.model_path = model_path
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.memory_saver = memory_saver
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.version = version
        parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split("+")[0].split(".")[:3]]
        self.update_session = tuple(parts) >= (0, 5, 21)
        self.deterministic = deterministic
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.health_delay_s = health_delay_s
        self.health_timeout_s = health_timeout_s
        self.eos_token_id = eos_token_id
        self.cond = threading.Condition()
        self.groups: dict[str, Any] = {}
        self.stopped = False
        self._defaults = (vocab_size, seed, model_kind)
        self.reset()
        self._thread = threading.Thread(target=self._schedule, name="fake-sglang-scheduler", daemon=True)
        self._thread.start()

    def reset(self, *, vocab_size: int | None = None, seed: int | None = None, model_kind: str | None = None) -> None:
        """Back to a fresh server (the launch arguments' model unless another is named)."""
        with self.cond:
            default_vocab, default_seed, default_kind = self._defaults
            self.vocab_size = vocab_size or default_vocab
            self.seed = default_seed if seed is None else seed
            self.model_kind = model_kind or default_kind
            self.rng = torch.Generator().manual_seed(self.seed + 1)
            self.weights = toy_weights(self.vocab_size, self.seed, self.model_kind)
            self.weight_version = "default"
            self.known: dict[str, _Request] = {}  # the tokenizer manager's rid_to_state
            self.running: dict[str, _Request] = {}  # what the scheduler holds
            self.is_pause = False  # the tokenizer manager's pause gate (new requests wait)
            self.paused: str | None = None  # the scheduler's pause mode (in_place / retract: no stepping)
            self.readers = 0  # requests holding the model-update lock's reader side
            self.writer = False  # an update holding its writer side
            self.session = False  # a /begin_weight_update session is open
            self.released: set[str] = set()
            self.faults: dict[str, Any] = {}
            self.counts: dict[str, int] = {}
            self.flushes = 0
            self.bodies: dict[str, Any] = {}  # the last body each route received
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            for req in self.running.values():
                req.finish = {"type": "abort", "message": "server shutting down"}
                req.done.set()
            self.cond.notify_all()

    # -- the toy scheduler -------------------------------------------------------

    def _schedule(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and (not self.running or self.paused is not None):
                    self.cond.wait()
                if self.stopped:
                    return
                for req in list(self.running.values()):
                    self._step(req)
            time.sleep(self.step_s)

    def _step(self, req: _Request) -> None:
        p = req.params
        if req.rid.startswith("HEALTH_CHECK"):
            return  # the /health probe's one token is not modelled; it runs for as long as the probe lasts
        previous = req.tokens[-1] if req.tokens else req.input_ids[-1]
        logits = toy_logits(self.weights, previous)
        temperature = float(p.get("temperature", 1.0))
        top_k = int(p.get("top_k") if p.get("top_k") is not None else -1)
        if temperature < GREEDY_BELOW:  # SGLang: greedy, temperature 1
            temperature, top_k = 1.0, 1
        top_p = float(p.get("top_p", 1.0))
        logp = torch.log_softmax(logits / temperature, -1)  # SGLang's reported log-prob: no renormalisation
        probs = logp.exp()
        # SGLang's PyTorch sampler: sort, keep the first top_k, and drop where the mass before a token already
        # exceeds top_p -- both cuts on the same untruncated distribution
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.clone()
        if 0 < top_k < keep.numel():
            keep[top_k:] = 0.0
        keep[(sorted_p.cumsum(0) - sorted_p) > top_p] = 0.0
        generator = req.generator if (req.generator is not None and self.deterministic) else self.rng
        index = int(torch.multinomial(keep / keep.sum(), 1, generator=generator))
        token = int(order[index])
        req.tokens.append(token)
        req.logprobs.append(float(logp[token]))
        req.selected.append(float(torch.log(keep[index] / keep.sum())))
        # SGLang's _check_token_based_finish: the request's stop ids and the model's EOS together, neither with
        # ignore_eos
        stops = set(p.get("stop_token_ids") or []) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        if token in stops and not p.get("ignore_eos"):
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.tokens) >= int(p.get("max_new_tokens", 128)):
            self._finish(req, {"type": "length", "length": len(req.tokens)})

    def _finish(self, req: _Request, reason: dict[str, Any]) -> None:
        if req.finish is None:
            req.finish = reason
        self.running.pop(req.rid, None)
        req.done.set()
        self.cond.notify_all()

    def _abort_in_scheduler(self, rid: str | None) -> None:
        """The scheduler's abort: ``None`` is abort_all; a rid aborts every request whose rid starts with it."""
        for req in list(self.running.values()):
            if rid is None or req.rid.startswith(rid):
                self._finish(req, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})

    def _record_version(self, new: str | None) -> None:
        """SGLang's ``record_weight_version_change``: live requests remember how many tokens the old one made."""
        if new is None or new == self.weight_version:
            return
        for req in self.running.values():
            if req.tokens:
                req.events.append((self.weight_version, len(req.tokens)))
        self.weight_version = new

    def _idle(self) -> bool:
        """SGLang's ``is_fully_idle(ignore_waiting=paused)``: retract moves running requests to the waiting queue."""
        return not self.running or self.paused == "retract"

    def _die(self, why: str) -> None:
        print(f"Scheduler hit an exception: {why}", file=sys.stderr, flush=True)
        raise _ServerDied(why)

    # -- routes ---------------------------------------------------------------------

    def _authorised(self, path: str, headers: dict[str, str]) -> None:
        """SGLang's ``decide_request_auth`` for the NORMAL and ADMIN_OPTIONAL levels."""
        if path.startswith(("/health", "/ready", "/metrics", "/_fake/")):
            return  # (/_fake/ routes are the test's own)
        key = (self.admin_api_key or self.api_key) if path in ADMIN_ROUTES else self.api_key
        if key and headers.get("authorization") != f"Bearer {key}":
            raise _HTTPError(401, {"error": "Unauthorized"})

    def route(self, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        self._authorised(path, headers)
        with self.cond:
            self.counts[path] = self.counts.get(path, 0) + 1
            self.bodies[path] = body
        handler = _ROUTES.get((method, path)) or _ROUTES.get(("*", path))
        if handler is None or (path in ("/begin_weight_update", "/end_weight_update") and not self.update_session):
            return 404, {"detail": "Not Found"}
        return handler(self, body if isinstance(body, dict) else {})

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            fault = self._take_fault("generate_status")
            delay = self.faults.get("generate_delay_s")
        if fault is not None:
            return fault, {"error": {"message": self.faults.get("generate_message", "injected failure")}}
        if delay:
            time.sleep(float(delay))
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise _validation_error("input_ids must be a non-empty list of token ids")
        params = body.get("sampling_params") or {}
        _check_contract(params)
        rid = body.get("rid") or uuid.uuid4().hex
        mask = bool(body.get("return_sampling_mask"))
        req = _Request(rid, ids, params, params.get("sampling_seed"), mask)
        with self.cond:
            if rid in self.known:
                raise _error(400, f"Duplicate request ID detected: {rid}")
            self.known[rid] = req  # known from here on: an abort finds it, even while it waits below
        try:
            return self._run_request(req, body)
        finally:
            with self.cond:
                self.known.pop(rid, None)

    def _run_request(self, req: _Request, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            # the tokenizer manager's pause gate, then the reader side of the model-update lock
            while not self.stopped and (self.is_pause or self.writer):
                self.cond.wait()
            self.readers += 1
        try:
            _verify(req.params)
            bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise _error(400, f"Input token ids {bad[:5]} are out of the vocabulary [0, {self.vocab_size})")
            if req.sampling_mask:
                top_k = req.params.get("top_k")
                top_k = -1 if top_k is None else top_k
                temperature = float(req.params.get("temperature", 1.0))
                if temperature >= GREEDY_BELOW and top_k != 1 and not 1 < top_k <= self.sampling_mask_max_tokens:
                    raise _error(400, "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < "
                                      f"top_k <= {self.sampling_mask_max_tokens}; got top_k={top_k}. Lower top_k "
                                      "or increase --sampling-mask-max-tokens.")
            with self.cond:
                if self.released & {"weights", "kv_cache"}:
                    raise _error(500, "memory is released (release_memory_occupation); resume it first")
                self.running[req.rid] = req
                self.cond.notify_all()
            req.done.wait()
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()
        with self.cond:
            spans = weight_version_spans(req.events, self.weight_version, len(req.tokens))
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.tokens),
            "cached_tokens": 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "e2e_latency": time.monotonic() - req.start,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.tokens, strict=True)]
        if req.sampling_mask:
            meta["output_token_sampling_logprobs"] = list(req.selected)
        return 200, {"text": "", "output_ids": list(req.tokens), "meta_info": meta}

    def _take_fault(self, name: str) -> Any:
        value = self.faults.get(name)
        if value is None:
            return None
        times = self.faults.get("times")
        if times is not None:
            if times <= 0:
                return None
            self.faults["times"] = times - 1
        return value

    def abort_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            if body.get("abort_all"):
                self._abort_in_scheduler(None)
                return 200, None
            rid = str(body.get("rid") or "")
            state = self.known.get(rid)
            if not rid or state is None or state.abort_sent:
                return 200, None  # unknown yet, or aborted before: SGLang drops it
            state.abort_sent = True
            self._abort_in_scheduler(rid)
        return 200, None

    def pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _validation_error(f"Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
        with self.cond:
            self.is_pause = True
            if mode == "abort":
                # abort_all until no request holds the model-update lock (those waiting at the gate stay held)
                while self.readers and not self.stopped:
                    self._abort_in_scheduler(None)
                    self.cond.wait(0.05)
            else:
                self.paused = mode
            self.cond.notify_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            self.is_pause = False
            self.paused = None
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _dp_check(self) -> None:
        if self.dp_size != 1:
            # an AssertionError in the tokenizer manager: FastAPI answers 500
            raise _HTTPError(500, "Internal Server Error")

    def init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._dp_check()
        try:
            address, port = body["master_address"], int(body["master_port"])
            rank_offset, world = int(body["rank_offset"]), int(body["world_size"])
            name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        except (KeyError, TypeError, ValueError) as exc:
            raise _validation_error(f"bad init_weights_update_group request: {exc}") from exc
        if world != rank_offset + self.tp_size:
            # SGLang would wait in the rendezvous for ranks that never come, then fail the same way
            return 400, {"success": False, "message": f"Failed to initialize custom process group: world_size "
                                                      f"{world} != rank_offset {rank_offset} + {self.tp_size} ranks."}
        if backend != "gloo":
            return 400, {"success": False, "message": f"the protocol fake runs on the CPU: backend must be gloo, "
                                                      f"got {backend!r}"}
        try:
            group = sglang_join(backend=backend, init_method=f"tcp://{address}:{port}", world_size=world,
                                rank=rank_offset, group_name=name, timeout_s=float(self.faults.get("join_timeout_s",
                                                                                                    60.0)))
        except Exception as exc:  # noqa: BLE001 - reported to the client, like SGLang does
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        self.groups[name] = group
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._dp_check()
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group(group)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    @contextlib.contextmanager
    def _update_lock(self) -> Iterator[None]:
        """Paused: the update runs at once. Otherwise it takes the writer side of the model-update lock."""
        with self.cond:
            paused = self.is_pause
            if not paused:
                while self.writer or (self.readers and not self.stopped):
                    self.cond.wait()
                self.writer = True
        try:
            yield
        finally:
            if not paused:
                with self.cond:
                    self.writer = False
                    self.cond.notify_all()

    def begin_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._update_lock(), self.cond:
            if self.session:
                return 400, {"success": False, "message": "a weight-update session is already open; call "
                                                          "end_weight_update() first"}
            self.session = True
        return 200, {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._update_lock(), self.cond:
            if not self.session:
                return 400, {"success": False, "message": "no weight-update session is open; call "
                                                          "begin_weight_update() first"}
            self.session = False
        return 200, {"success": True, "message": "Success"}

    def _after_load(self, body: dict[str, Any]) -> tuple[int, Any]:
        """What the scheduler does once a load succeeded: record the version, flush (failing the call if busy)."""
        with self.cond:
            self._record_version(body.get("weight_version"))
            if body.get("flush_cache", True):
                if not self._idle():
                    return 400, {"success": False, "message": (
                        "Weights were updated, but the cache was not flushed because requests are still running or "
                        "queued. Retract or finish them, then call /flush_cache.")}
                self.flushes += 1
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def update_weights_from_distributed(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._dp_check()
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        name = body.get("group_name", "weight_update_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise _validation_error("names, dtypes and shapes are required lists")
        if body.get("abort_all_requests"):
            with self.cond:
                self._abort_in_scheduler(None)
        with self._update_lock():
            if self.update_session and not self.session:
                # refused before any receive is posted: a sender's broadcast finds no receiver
                return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                          "begin_weight_update() and end_weight_update()"}
            group = self.groups.get(name)
            if group is None:
                return 400, {"success": False, "message": f"Failed to receive weights: Group {name} not in "
                                                          f"{sorted(self.groups)}. Please call "
                                                          "`init_weights_update_group` first."}
            received = []
            for n, d, s in zip(names, dtypes, shapes, strict=False):
                tensor = torch.empty(s, dtype=getattr(torch, d))
                torch.distributed.broadcast(tensor, src=0, group=group)
                received.append((n, tensor))
            with self.cond:
                for n, tensor in received:
                    target = self.weights.get(n)
                    if target is None or target.shape != tensor.shape:
                        return 400, {"success": False, "message": (
                            f"Failed to update parameter online: {n!r} (shape {tuple(tensor.shape)}) is not a "
                            "parameter of the model. The full weights of the ModelRunner are partially updated. "
                            "Please discard the whole weights.")}
                    self.weights[n] = tensor.to(target.dtype)
            return self._after_load(body)

    def update_weights_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._dp_check()
        with self._update_lock():
            if self.update_session and not self.session:
                return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                                                          "begin_weight_update() and end_weight_update()"}
            return 400, {"success": False, "message": "the protocol fake cannot map CUDA IPC handles; test "
                                                      "weight_sync.mode: distributed (gloo) here"}

    def update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        if "new_version" not in body:
            raise _validation_error("new_version: Field required")
        with self.cond:
            if body.get("abort_all_requests", True):
                self._abort_in_scheduler(None)
            self._record_version(str(body["new_version"]))
        return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                     "new_version": body["new_version"]}

    def flush_cache(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            if not self._idle():
                return 400, "Flush cache failed.\n"
            self.flushes += 1
        return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                     "waiting requests, the operation will not be performed.)\n")

    def release_memory_occupation(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not self.memory_saver:
            raise _error(400, "release_memory_occupation needs --enable-memory-saver (the protocol fake refuses "
                              "what SGLang would silently skip)")
        with self.cond:
            if self.running and not (self.is_pause and self.paused == "retract"):
                self._die("AssertionError: release_memory_occupation should be called only when server is idle.")
            self.released |= set(body.get("tags") or ALL_MEMORY_TAGS)
        return 200, None

    def resume_memory_occupation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            for tag in body.get("tags") or ALL_MEMORY_TAGS:
                if tag not in self.released:
                    self._die(f"KeyError: {tag!r} (resume_memory_occupation of a tag that was not released)")
                self.released.discard(tag)
        return 200, None

    def health(self, body: dict[str, Any]) -> tuple[int, Any]:
        """SGLang's /health (and /health_generate): a one-token generation, judged after a 1 s sleep."""
        if self.faults.get("unhealthy"):
            return 503, None
        deadline = time.monotonic() + self.health_timeout_s
        probe = _Request(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], {"max_new_tokens": 1}, None, False)
        with self.cond:
            while self.is_pause or self.writer:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopped:
                    return 503, None
                self.cond.wait(left)
            self.running[probe.rid] = probe  # a request while it lasts: /flush_cache answers 400 meanwhile
        try:
            time.sleep(float(self.faults.get("health_delay_s", self.health_delay_s)))
        finally:
            with self.cond:
                self.running.pop(probe.rid, None)
                self.cond.notify_all()
        return 200, None

    def ready(self, body: dict[str, Any]) -> tuple[int, Any]:
        return (503 if self.is_pause else 200), None

    def model_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.faults.get("unhealthy"):
            return 503, None
        return 200, {"model_path": self.model_path, "served_model_name": self.model_path,
                     "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
                     "weight_version": self.weight_version}

    def server_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"model_path": self.model_path, "tp_size": self.tp_size, "dp_size": self.dp_size, "pp_size": 1,
                     "enable_memory_saver": self.memory_saver, "enable_deterministic_inference": self.deterministic,
                     "sampling_mask_max_tokens": self.sampling_mask_max_tokens, "internal_states": [{}],
                     "version": self.version, "frontend": "python"}

    # fake-only routes
    def set_faults(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            self.faults = dict(body)
            self.cond.notify_all()
        return 200, {"faults": self.faults}

    def state(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            return 200, {
                "weight_version": self.weight_version, "paused": self.paused, "is_pause": self.is_pause,
                "running": sorted(r.rid for r in self.running.values() if not r.rid.startswith("HEALTH_CHECK")),
                "known": sorted(self.known), "session": self.session,
                "probes": sum(r.rid.startswith("HEALTH_CHECK") for r in self.running.values()),
                "progress": {rid: len(r.tokens) for rid, r in self.running.items()},
                "released": sorted(self.released), "flushes": self.flushes, "counts": dict(self.counts),
                "groups": sorted(self.groups), "bodies": self.bodies,
                "weights": {n: t.tolist() for n, t in self.weights.items()},
            }

    def reset_route(self, body: dict[str, Any]) -> tuple[int, Any]:
        kind = body.get("model_kind")
        if kind not in (None, "lm_head", "bigram"):
            raise _error(400, f"model_kind must be lm_head or bigram, got {kind!r}")
        self.reset(vocab_size=body.get("vocab_size"), seed=body.get("seed"), model_kind=kind)
        return 200, None


_ROUTES = {
    ("*", "/generate"): ProtocolFake.generate,
    ("POST", "/abort_request"): ProtocolFake.abort_request,
    ("POST", "/pause_generation"): ProtocolFake.pause_generation,
    ("POST", "/continue_generation"): ProtocolFake.continue_generation,
    ("POST", "/init_weights_update_group"): ProtocolFake.init_weights_update_group,
    ("POST", "/destroy_weights_update_group"): ProtocolFake.destroy_weights_update_group,
    ("POST", "/begin_weight_update"): ProtocolFake.begin_weight_update,
    ("POST", "/end_weight_update"): ProtocolFake.end_weight_update,
    ("POST", "/update_weights_from_distributed"): ProtocolFake.update_weights_from_distributed,
    ("POST", "/update_weights_from_tensor"): ProtocolFake.update_weights_from_tensor,
    ("POST", "/update_weight_version"): ProtocolFake.update_weight_version,
    ("*", "/flush_cache"): ProtocolFake.flush_cache,
    ("*", "/release_memory_occupation"): ProtocolFake.release_memory_occupation,
    ("*", "/resume_memory_occupation"): ProtocolFake.resume_memory_occupation,
    ("GET", "/health"): ProtocolFake.health,
    ("GET", "/health_generate"): ProtocolFake.health,
    ("GET", "/ready"): ProtocolFake.ready,
    ("GET", "/model_info"): ProtocolFake.model_info,
    ("GET", "/get_model_info"): ProtocolFake.model_info,
    ("GET", "/server_info"): ProtocolFake.server_info,
    ("GET", "/get_server_info"): ProtocolFake.server_info,
    ("POST", "/_fake/faults"): ProtocolFake.set_faults,
    ("GET", "/_fake/state"): ProtocolFake.state,
    ("POST", "/_fake/reset"): ProtocolFake.reset_route,
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
    #: SGLang runs uvicorn with ``timeout_keep_alive=SGLANG_TIMEOUT_KEEP_ALIVE`` (5 s): an idle connection is closed
    #: after that, so a client must not reuse one longer (set per server from ``--timeout-keep-alive``)
    timeout: float | None = 5.0
    fake: ProtocolFake

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: tests read state, not logs
        pass

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return self._send(400, {"error": {"message": "request body is not JSON"}})
        try:
            status, payload = self.fake.route(method, self.path.split("?")[0], body,
                                              {k.lower(): v for k, v in self.headers.items()})
        except _HTTPError as exc:
            status, payload = exc.status, exc.payload
        except _ServerDied:
            # the scheduler's exception SIGQUITs the launcher: the whole server goes, this call unanswered
            os._exit(1)
        except Exception as exc:  # noqa: BLE001 - a bug in the fake answers 500 instead of dropping the connection
            status, payload = 500, {"object": "error", "message": f"{type(exc).__name__}: {exc}", "code": 500}
        self._send(status, payload)

    def _send(self, status: int, payload: Any) -> None:
        if payload is None:
            data, kind = b"", "text/plain"
        elif isinstance(payload, str):
            data, kind = payload.encode(), "text/plain"
        else:
            data, kind = json.dumps(payload).encode(), "application/json"
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("POST")


#: uvicorn's default ``backlog`` (SGLang 0.5.20 to 0.5.23 keep it): socketserver's default of 5 overflows when a
#: client opens tens of connections at once, and the kernel then resets or stalls some of them (on this machine a
#: burst of 32 /generate calls lost about a third to ``ReadError``), which no real SGLang server does
LISTEN_BACKLOG = 2048


class _Server(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


def serve(fake: ProtocolFake, host: str, port: int, *, keep_alive_s: float = 5.0) -> ThreadingHTTPServer:
    """An HTTP server for ``fake`` on ``host:port`` (loopback only); call ``serve_forever`` on it.

    It listens with uvicorn's backlog and closes a connection idle for ``keep_alive_s``, as SGLang's uvicorn does.
    """
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the protocol fake binds to loopback only, got --host {host}")
    handler = type("Handler", (_Handler,), {"fake": fake, "timeout": keep_alive_s})
    return _Server((host, port), handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncflow_sglang.testing",
                                     description="Protocol fake of an SGLang server (a toy bigram model; not SGLang).")
    parser.add_argument("--model-path", required=True, help="Recorded only; the fake serves a toy bigram table.")
    parser.add_argument("--host", default="127.0.0.1", help="Loopback address to bind (127.0.0.1, localhost, ::1).")
    parser.add_argument("--port", type=int, default=30000, help="Port to bind.")
    parser.add_argument("--tp-size", type=int, default=1, help="Ranks that join a weight-update group.")
    parser.add_argument("--dp-size", type=int, default=1, help="Reported; above 1 the weight-group routes fail.")
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="Accepted and ignored.")
    parser.add_argument("--dtype", default=None, help="Accepted and ignored.")
    parser.add_argument("--random-seed", type=int, default=0, help="Seed of the toy weights and sampler.")
    parser.add_argument("--enable-memory-saver", action="store_true", help="Allow release/resume_memory_occupation.")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="Honour sampling_seed (ignored without it, as in SGLang).")
    parser.add_argument("--sampling-mask-max-tokens", type=int, default=4096, help="Largest top_k for "
                        "return_sampling_mask.")
    parser.add_argument("--api-key", default=None, help="Require this bearer token.")
    parser.add_argument("--admin-api-key", default=None, help="Require this bearer token on the admin routes.")
    parser.add_argument("--version", default=FAKE_VERSION, help="The SGLang version /server_info reports.")
    parser.add_argument("--health-delay-s", type=float, default=1.0, help="How long /health takes (SGLang: >= 1 s).")
    parser.add_argument("--health-timeout-s", type=float, default=20.0,
                        help="When /health gives up while paused or updating (SGLang: 20 s).")
    parser.add_argument("--vocab-size", type=int, default=32, help="Toy vocabulary size.")
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="The model's EOS: it ends a completion like a stop id (unless ignore_eos), as in SGLang.")
    parser.add_argument("--step-ms", type=float, default=2.0, help="Milliseconds per decoding step.")
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="Close a connection idle this long (SGLang: SGLANG_TIMEOUT_KEEP_ALIVE, 5 s).")
    parser.add_argument("--model-kind", choices=["lm_head", "bigram"], default="lm_head",
                        help="lm_head: lm_head.weight + lm_head.bias; bigram: the toy trainer's bigram.weight table.")
    args = parser.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"error: the protocol fake binds to loopback only, got --host {args.host}", file=sys.stderr)
        return 2
    fake = ProtocolFake(vocab_size=args.vocab_size, seed=args.random_seed, step_ms=args.step_ms,
                        model_path=args.model_path, tp_size=args.tp_size, dp_size=args.dp_size,
                        memory_saver=args.enable_memory_saver, api_key=args.api_key,
                        admin_api_key=args.admin_api_key, model_kind=args.model_kind, version=args.version,
                        deterministic=args.enable_deterministic_inference,
                        sampling_mask_max_tokens=args.sampling_mask_max_tokens, health_delay_s=args.health_delay_s,
                        health_timeout_s=args.health_timeout_s, eos_token_id=args.eos_token_id)
    server = serve(fake, args.host, args.port, keep_alive_s=args.timeout_keep_alive)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        fake.stop()
        server.server_close()
    return 0


class FakeServer:
    """A protocol fake running in a child process (tests start it, read its URL, stop it)."""

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process = process
        self.url = url

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """A plain HTTP call to the fake (for tests' fake-only routes)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
        with opener.open(request, timeout=30) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def state(self) -> dict[str, Any]:
        return self.call("GET", "/_fake/state")

    def faults(self, **faults: Any) -> None:
        self.call("POST", "/_fake/faults", faults)

    def reset(self, **model: Any) -> None:
        """Back to a fresh server; ``model_kind``, ``vocab_size``, ``seed`` pick another toy model."""
        self.call("POST", "/_fake/reset", model)

    def died(self, timeout_s: float = 30.0) -> bool:
        """Whether the fake process exited within ``timeout_s`` (it dies as SGLang's server does)."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crashed SGLang would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def fake_command() -> list[str]:
    """The command that runs the fake like ``launch_server`` (for ``launch.command``)."""
    return [sys.executable, "-m", "asyncflow_sglang.testing"]


@contextlib.contextmanager
def fake_server(*args: str, startup_timeout_s: float = 60.0) -> Iterator[FakeServer]:
    """Run the protocol fake in a child process on a free 127.0.0.1 port until the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([*fake_command(), "--model-path", "toy", "--host", "127.0.0.1", "--port", str(port),
                                *args], env=env, stdout=subprocess.DEVNULL, stderr=log)
    server = FakeServer(process, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the protocol fake exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                server.call("GET", "/ready")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the protocol fake did not answer /ready within {startup_timeout_s}s")
                time.sleep(0.05)
        yield server
    finally:
        server.stop()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
