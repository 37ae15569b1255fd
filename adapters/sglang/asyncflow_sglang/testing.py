"""A protocol fake of the SGLang HTTP server, for tests on machines without a GPU. It is NOT SGLang.

SGLang has no CPU build, so the adapter's tests run against this small HTTP
server instead. It implements the routes the adapter uses with the request
and response shapes of SGLang's ``http_server.py`` / ``io_struct.py``
(checked against SGLang's main branch, 0.5.x): ``/generate``,
``/abort_request``, ``/pause_generation`` (abort / in_place / retract),
``/continue_generation``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/update_weight_version``, ``/flush_cache``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/health``, ``/health_generate``,
``/get_model_info`` and ``/get_server_info``. ``/update_weights_from_tensor``
answers 400: it needs CUDA IPC handles.

The "model" is a toy bigram table: the logits of the next token are
``lm_head.weight[previous token] + lm_head.bias`` (or, with ``--model-kind
bigram``, ``bigram.weight[previous token]``, the ``toy`` trainer's table), sampled one token per
``step_ms`` for every running request, with temperature, top-k and top-p. The
log-prob it reports follows SGLang's default: ``log_softmax(logits /
temperature)`` at the sampled token, not renormalised after top-k/top-p.
Because sampling reads the weights, a test sees a weight update take effect.
The weight-update group is joined with the store layout SGLang's servers use
(:mod:`asyncflow_sglang.weight_group`), with gloo on the CPU. What it does not
model: tokenization and text, batching limits, KV-cache memory, multiple
ranks, streaming, and CUDA anything.

Fake-only routes for tests (no SGLang has them): ``POST /_fake/faults``
(``{"generate_status": 500, "generate_message": "...", "generate_delay_s": 3,
"unhealthy": true, "times": 1}``), ``GET /_fake/state`` and ``POST
/_fake/reset`` (``{"model_kind": "bigram", "vocab_size": 16, "seed": 0}`` switches the toy model).

Run it like ``launch_server``: ``python -m asyncflow_sglang.testing
--model-path toy --host 127.0.0.1 --port 30000`` (loopback only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

#: What /get_server_info reports: an SGLang version number the adapter accepts, marked as the fake
FAKE_VERSION = "0.5.6+protocol-fake"

#: sampling_params keys SGLang's SamplingParams accepts (a subset; an unknown key is refused, as SGLang does)
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "sampling_seed", "json_schema", "regex", "ebnf", "custom_params",
    "stream_interval", "logit_bias",
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


class _Request:
    """One /generate request inside the fake."""

    def __init__(self, rid: str, input_ids: list[int], params: dict[str, Any], seed: int | None) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict[str, Any] | None = None
        self.done = threading.Event()
        self.start = time.monotonic()


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ProtocolFake:
    """The fake server's state and its toy scheduler (one thread stepping every running request)."""

    def __init__(self, *, vocab_size: int = 32, seed: int = 0, step_ms: float = 2.0, model_path: str = "toy",
                 tp_size: int = 1, memory_saver: bool = False, api_key: str | None = None,
                 model_kind: str = "lm_head") -> None:
        self.vocab_size = vocab_size
        self.model_kind = model_kind
        self.seed = seed
        self.step_s = step_ms / 1000.0
        self.model_path = model_path
        self.tp_size = tp_size
        self.memory_saver = memory_saver
        self.api_key = api_key
        self.cond = threading.Condition()
        self.rng = torch.Generator().manual_seed(seed + 1)
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
            self.running: dict[str, _Request] = {}
            self.paused: str | None = None
            self.updating = False
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
        previous = req.tokens[-1] if req.tokens else req.input_ids[-1]
        logits = toy_logits(self.weights, previous)
        temperature = float(p.get("temperature", 1.0))
        if temperature <= 0:
            token = int(torch.argmax(logits))
            logprob = float(torch.log_softmax(logits, -1)[token])
        else:
            scaled = logits / temperature
            logp = torch.log_softmax(scaled, -1)  # SGLang's reported log-prob: no truncation renormalisation
            probs = logp.exp()
            top_k = int(p.get("top_k", -1))
            if 0 < top_k < probs.numel():
                kth = torch.topk(probs, top_k).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            top_p = float(p.get("top_p", 1.0))
            if top_p < 1.0:
                sorted_p, order = torch.sort(probs / probs.sum(), descending=True)
                drop = (sorted_p.cumsum(0) - sorted_p) > top_p
                probs = probs.clone()
                probs[order[drop]] = 0.0
            token = int(torch.multinomial(probs / probs.sum(), 1, generator=req.generator or self.rng))
            logprob = float(logp[token])
        req.tokens.append(token)
        req.logprobs.append(logprob)
        stops = set(p.get("stop_token_ids") or [])
        if token in stops:
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.tokens) >= int(p.get("max_new_tokens", 128)):
            self._finish(req, {"type": "length", "length": len(req.tokens)})

    def _finish(self, req: _Request, reason: dict[str, Any]) -> None:
        if req.finish is None:
            req.finish = reason
        self.running.pop(req.rid, None)
        req.done.set()
        self.cond.notify_all()

    def _abort(self, rid: str | None) -> None:
        for req in list(self.running.values()):
            if rid is None or req.rid == rid:
                self._finish(req, {"type": "abort", "message": "Abort in running queue"})

    # -- routes ---------------------------------------------------------------------

    def route(self, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        if (self.api_key and path not in ("/health", "/health_generate")
                and headers.get("authorization") != f"Bearer {self.api_key}"):
            raise _HTTPError(401, "Unauthorized")
        with self.cond:
            self.counts[path] = self.counts.get(path, 0) + 1
            self.bodies[path] = body
        handler = _ROUTES.get((method, path)) or _ROUTES.get(("*", path))
        if handler is None:
            raise _HTTPError(404, f"Not Found: {method} {path}")
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
            raise _HTTPError(400, "input_ids must be a non-empty list of token ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise _HTTPError(400, f"Input token ids {bad[:5]} are out of the vocabulary [0, {self.vocab_size})")
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            raise _HTTPError(400, f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
        rid = body.get("rid") or uuid.uuid4().hex
        seed = params.get("sampling_seed")
        req = _Request(rid, ids, params, seed)
        with self.cond:
            # like SGLang: a paused server, or one loading weights, holds new requests
            while not self.stopped and (self.paused is not None or self.updating):
                self.cond.wait()
            if "weights" in self.released or "kv_cache" in self.released:
                raise _HTTPError(500, "memory is released (release_memory_occupation); resume it first")
            if rid in self.running:
                raise _HTTPError(400, f"Duplicate request ID: {rid}")
            self.running[rid] = req
            self.cond.notify_all()
        req.done.wait()
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(req.tokens),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - req.start,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.tokens, strict=True)]
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
            self._abort(None if body.get("abort_all") else str(body.get("rid", "")))
        return 200, None

    def pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _HTTPError(400, f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        with self.cond:
            if mode == "abort":
                self._abort(None)
            self.paused = mode
            self.cond.notify_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            self.paused = None
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        from asyncflow_sglang import weight_group

        try:
            address, port = body["master_address"], int(body["master_port"])
            rank_offset, world = int(body["rank_offset"]), int(body["world_size"])
            name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        except (KeyError, TypeError, ValueError) as exc:
            raise _HTTPError(400, f"bad init_weights_update_group request: {exc}") from exc
        if world != rank_offset + self.tp_size:
            return 400, {"success": False, "message": f"world_size {world} != rank_offset {rank_offset} + this "
                                                      f"server's {self.tp_size} ranks"}
        if backend != "gloo":
            return 400, {"success": False, "message": f"the protocol fake runs on the CPU: backend must be gloo, "
                                                      f"got {backend!r}"}
        try:
            group = weight_group.join(backend=backend, init_method=f"tcp://{address}:{port}", rank=rank_offset,
                                      world_size=world, group_name=name, timeout_s=60.0)
        except Exception as exc:  # noqa: BLE001 - reported to the client, like SGLang does
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        self.groups[name] = group
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        from asyncflow_sglang import weight_group

        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return 400, {"success": False, "message": "no such group"}
        weight_group.destroy(group)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_distributed(self, body: dict[str, Any]) -> tuple[int, Any]:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        name = body.get("group_name", "weight_update_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise _HTTPError(400, "names, dtypes and shapes must be lists of one length")
        group = self.groups.get(name)
        if group is None:
            return 400, {"success": False, "message": f"Group {name} not in {sorted(self.groups)}. Please call "
                                                      "`init_weights_update_group` first."}
        with self.cond:
            if body.get("abort_all_requests"):
                self._abort(None)
            # not paused: wait until no request runs (SGLang's model-update writer lock), holding new ones
            self.updating = True
            while self.paused is None and self.running and not self.stopped:
                self.cond.wait()
        try:
            received = []
            for n, d, s in zip(names, dtypes, shapes, strict=True):
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
                if body.get("flush_cache", True):
                    self.flushes += 1
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
        finally:
            with self.cond:
                self.updating = False
                self.cond.notify_all()
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def update_weights_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 400, {"success": False, "message": "the protocol fake cannot map CUDA IPC handles; test "
                                                  "weight_sync.mode: distributed (gloo) here"}

    def update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        if "new_version" not in body:
            raise _HTTPError(400, "new_version is required")
        with self.cond:
            if body.get("abort_all_requests", True):
                self._abort(None)
            self.weight_version = str(body["new_version"])
        return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                     "new_version": body["new_version"]}

    def flush_cache(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            if self.running and self.paused != "retract":
                return 400, "Cache not flushed: there are running or waiting requests.\n"
            self.flushes += 1
        return 200, "Cache flushed.\nPlease check backend logs for more details.\n"

    def release_memory_occupation(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not self.memory_saver:
            raise _HTTPError(400, "release_memory_occupation needs --enable-memory-saver")
        with self.cond:
            self.released |= set(body.get("tags") or ["weights", "kv_cache"])
        return 200, None

    def resume_memory_occupation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            tags = body.get("tags")
            self.released -= set(tags) if tags else set(self.released)
        return 200, None

    def health(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.faults.get("unhealthy"):
            return 503, None
        return 200, None

    def model_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                     "preferred_sampling_params": None, "weight_version": self.weight_version}

    def server_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"model_path": self.model_path, "tp_size": self.tp_size, "dp_size": 1,
                     "enable_memory_saver": self.memory_saver, "weight_version": self.weight_version,
                     "internal_states": [{}], "version": FAKE_VERSION}

    # fake-only routes
    def set_faults(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            self.faults = dict(body)
            self.cond.notify_all()
        return 200, {"faults": self.faults}

    def state(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            return 200, {
                "weight_version": self.weight_version, "paused": self.paused, "running": sorted(self.running),
                "progress": {rid: len(r.tokens) for rid, r in self.running.items()},
                "released": sorted(self.released), "flushes": self.flushes, "counts": dict(self.counts),
                "groups": sorted(self.groups), "bodies": self.bodies,
                "weights": {n: t.tolist() for n, t in self.weights.items()},
            }

    def reset_route(self, body: dict[str, Any]) -> tuple[int, Any]:
        kind = body.get("model_kind")
        if kind not in (None, "lm_head", "bigram"):
            raise _HTTPError(400, f"model_kind must be lm_head or bigram, got {kind!r}")
        self.reset(vocab_size=body.get("vocab_size"), seed=body.get("seed"), model_kind=kind)
        return 200, None


_ROUTES = {
    ("*", "/generate"): ProtocolFake.generate,
    ("POST", "/abort_request"): ProtocolFake.abort_request,
    ("POST", "/pause_generation"): ProtocolFake.pause_generation,
    ("POST", "/continue_generation"): ProtocolFake.continue_generation,
    ("POST", "/init_weights_update_group"): ProtocolFake.init_weights_update_group,
    ("POST", "/destroy_weights_update_group"): ProtocolFake.destroy_weights_update_group,
    ("POST", "/update_weights_from_distributed"): ProtocolFake.update_weights_from_distributed,
    ("POST", "/update_weights_from_tensor"): ProtocolFake.update_weights_from_tensor,
    ("POST", "/update_weight_version"): ProtocolFake.update_weight_version,
    ("*", "/flush_cache"): ProtocolFake.flush_cache,
    ("*", "/release_memory_occupation"): ProtocolFake.release_memory_occupation,
    ("*", "/resume_memory_occupation"): ProtocolFake.resume_memory_occupation,
    ("GET", "/health"): ProtocolFake.health,
    ("GET", "/health_generate"): ProtocolFake.health,
    ("GET", "/get_model_info"): ProtocolFake.model_info,
    ("GET", "/get_server_info"): ProtocolFake.server_info,
    ("POST", "/_fake/faults"): ProtocolFake.set_faults,
    ("GET", "/_fake/state"): ProtocolFake.state,
    ("POST", "/_fake/reset"): ProtocolFake.reset_route,
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
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
            # SGLang's _create_error_response shape
            status, payload = exc.status, {"error": {"message": exc.message}}
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


def serve(fake: ProtocolFake, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server for ``fake`` on ``host:port`` (loopback only); call ``serve_forever`` on it."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the protocol fake binds to loopback only, got --host {host}")
    handler = type("Handler", (_Handler,), {"fake": fake})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncflow_sglang.testing",
                                     description="Protocol fake of an SGLang server (a toy bigram model; not SGLang).")
    parser.add_argument("--model-path", required=True, help="Recorded only; the fake serves a toy bigram table.")
    parser.add_argument("--host", default="127.0.0.1", help="Loopback address to bind (127.0.0.1, localhost, ::1).")
    parser.add_argument("--port", type=int, default=30000, help="Port to bind.")
    parser.add_argument("--tp-size", type=int, default=1, help="Ranks that join a weight-update group.")
    parser.add_argument("--dp-size", type=int, default=1, help="Accepted and ignored (launch_server compatibility).")
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="Accepted and ignored.")
    parser.add_argument("--dtype", default=None, help="Accepted and ignored.")
    parser.add_argument("--random-seed", type=int, default=0, help="Seed of the toy weights and sampler.")
    parser.add_argument("--enable-memory-saver", action="store_true", help="Allow release/resume_memory_occupation.")
    parser.add_argument("--api-key", default=None, help="Require this bearer token.")
    parser.add_argument("--vocab-size", type=int, default=32, help="Toy vocabulary size.")
    parser.add_argument("--step-ms", type=float, default=2.0, help="Milliseconds per decoding step.")
    parser.add_argument("--model-kind", choices=["lm_head", "bigram"], default="lm_head",
                        help="lm_head: lm_head.weight + lm_head.bias; bigram: the toy trainer's bigram.weight table.")
    args = parser.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"error: the protocol fake binds to loopback only, got --host {args.host}", file=sys.stderr)
        return 2
    fake = ProtocolFake(vocab_size=args.vocab_size, seed=args.random_seed, step_ms=args.step_ms,
                        model_path=args.model_path, tp_size=args.tp_size, memory_saver=args.enable_memory_saver,
                        api_key=args.api_key, model_kind=args.model_kind)
    server = serve(fake, args.host, args.port)
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
                server.call("GET", "/health")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the protocol fake did not answer /health within {startup_timeout_s}s")
                time.sleep(0.05)
        yield server
    finally:
        server.stop()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
