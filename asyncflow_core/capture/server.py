"""The capture endpoint: an OpenAI-compatible ``/v1/chat/completions`` served with aiohttp on 127.0.0.1.

Routes (every one needs ``Authorization: Bearer <api_key>``, the per-run key):

- ``POST /s/<session>/v1/chat/completions``: a chat call, recorded on the session;
- ``POST /s/<session>/v1/completions``: a raw completion (text or token-id prompt, no chat template);
- ``GET  /s/<session>/v1/models``: the one model served;
- ``POST /s/<session>/reward`` with ``{"reward": <number>}``: the agent's own score for the episode.

Anything refused gets an HTTP 4xx (5xx when the engine failed) and one line
in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.

``stream=true`` (both completion routes) is answered as Server-Sent Events
once the call is sampled and recorded (see :mod:`asyncflow_core.capture.stream`):
a refusal or an engine failure is still a plain HTTP error, sent before any
chunk.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping
from typing import Any

from asyncflow_core.capture import stream as sse
from asyncflow_core.capture.recorder import (
    CaptureError,
    CaptureSession,
    ChatCall,
    ChatRenderer,
    SampleFn,
    TextCall,
    bad,
    normalize_messages,
)
from asyncflow_core.errors import ConfigError
from asyncflow_core.types.generation import SamplingParams

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
ROUTES = ("POST /s/<session>/v1/chat/completions, POST /s/<session>/v1/completions, GET /s/<session>/v1/models, "
          "POST /s/<session>/reward")


def _web():
    try:
        from aiohttp import web
    except ImportError:
        raise ConfigError("the capture endpoint needs aiohttp: pip install 'asyncflow[agents]'") from None
    return web


class CaptureServer:
    """Serves black-box agents and records each session's calls as a :class:`Trajectory`.

    ``sample(prompt_ids, sampling)`` generates one completion (the rollout
    stage's, routed through its replicas); None: every session passes its
    own to :meth:`open_session`. ``tokenizer`` is the model's
    Hugging Face tokenizer (or the runtime's ``HFTokenizer``) with a chat
    template. ``sampling`` is the run's: its temperature, top-p, top-k and stop
    ids are used for every call, and its ``max_new_tokens`` caps the agent's
    ``max_tokens``; with ``honor_agent_sampling`` the agent's ``temperature``
    and ``top_p`` are used instead. Stop ids default to the tokenizer's EOS.

    Use as ``async with CaptureServer(...) as server:``; it listens on
    127.0.0.1 on a free port, with a fresh bearer key per server.
    """

    def __init__(self, sample: SampleFn | None, tokenizer: Any, *, model: str = "policy",
                 sampling: SamplingParams | None = None, honor_agent_sampling: bool = False,
                 api_key: str | None = None, max_request_bytes: int = 64 << 20) -> None:
        self.renderer = ChatRenderer(tokenizer)
        sampling = sampling or SamplingParams()
        if not sampling.stop_token_ids:
            eos = getattr(getattr(tokenizer, "hf", tokenizer), "eos_token_id", None)
            if isinstance(eos, int):
                sampling = SamplingParams(**{**_fields(sampling), "stop_token_ids": (eos,)})
        self.sampling = sampling
        self.honor_agent_sampling = honor_agent_sampling
        self.model = model
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.sessions: dict[str, CaptureSession] = {}
        self._sample = sample
        self._max_request_bytes = max_request_bytes
        self._runner: Any = None
        self.port: int | None = None

    # -- lifecycle

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the capture server is not started; use `async with CaptureServer(...)`")
        return f"http://{HOST}:{self.port}"

    async def start(self) -> None:
        web = _web()
        if self._runner is not None:
            return
        app = web.Application(middlewares=[self._middleware(web)], client_max_size=self._max_request_bytes)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{session}/v1/completions", self._completions)
        app.router.add_get("/s/{session}/v1/models", self._models)
        app.router.add_post("/s/{session}/reward", self._reward)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, HOST, 0)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop listening and close every connection; sessions stay readable."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.port = None

    async def __aenter__(self) -> CaptureServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- sessions

    def open_session(self, metadata: Mapping[str, Any] | None = None, *,
                     sample: SampleFn | None = None) -> CaptureSession:
        """A new episode: give the agent ``session.base_url`` and ``session.api_key``.

        ``sample``: this session's generation (default: the server's); a run's captured episode passes its own,
        so each call becomes that episode's turn request in the rollout stage's dispatch.
        """
        sample = sample or self._sample
        if sample is None:
            raise ValueError("this capture server has no sample function: pass open_session(sample=...)")
        sid = secrets.token_hex(8)
        session = CaptureSession(sid, f"{self.url}/s/{sid}/v1", self.api_key, renderer=self.renderer,
                                 sample=sample, model=self.model, metadata=metadata)
        self.sessions[sid] = session
        return session

    async def close_session(self, session: CaptureSession | str):
        """Close a session, forget it, and return its :class:`Trajectory` (see ``CaptureSession.close``)."""
        sid = session if isinstance(session, str) else session.id
        if sid not in self.sessions:
            raise KeyError(f"unknown session {sid!r}")
        return await self.sessions.pop(sid).close()

    # -- HTTP

    def _session(self, request: Any) -> CaptureSession:
        got = request.headers.get("Authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise CaptureError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                               "the capture server gave the session", code="invalid_api_key")
        sid = request.match_info["session"]
        session = self.sessions.get(sid)
        if session is None:
            raise CaptureError(404, f"unknown session {sid!r}: open one with CaptureServer.open_session() and use "
                               "its base_url", code="session_not_found")
        return session

    @staticmethod
    async def _json(request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise bad("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _chat(self, request: Any) -> Any:
        session = self._session(request)
        body = await self._json(request)
        call = self.parse_chat(body)
        stream = self.parse_stream(body)
        answer = await session.chat_answer(call)
        if stream is None:
            return _web().json_response(answer.body)
        return await self._send(request, sse.chat_chunks(answer, self.renderer.decode, include_usage=stream))

    async def _completions(self, request: Any) -> Any:
        session = self._session(request)
        body = await self._json(request)
        call = self.parse_completion(body)
        stream = self.parse_stream(body)
        answer = await session.complete_answer(call)
        if stream is None:
            return _web().json_response(answer.body)
        return await self._send(request, sse.completion_chunks(answer, self.renderer.decode, include_usage=stream))

    async def _send(self, request: Any, chunks: Any) -> Any:
        """A recorded answer as Server-Sent Events; an agent that hangs up mid-stream loses only its copy.

        The events are built before the headers go out (a bug there is still a one-line 500) and written at once:
        the reply is whole already."""
        web = _web()
        events = b"".join(sse.event(chunk) for chunk in chunks) + sse.DONE
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await resp.write(events)
            await resp.write_eof()
        except (ConnectionError, RuntimeError) as exc:  # the client went away (the call is recorded already)
            log.debug("capture endpoint: the agent closed the stream early: %s", exc)
        return resp

    async def _models(self, request: Any) -> Any:
        self._session(request)
        return _web().json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncflow"}]})

    async def _reward(self, request: Any) -> Any:
        session = self._session(request)
        body = await self._json(request)
        if "reward" not in body:
            raise bad("missing 'reward': post {\"reward\": <number>}", "reward")
        session.post_reward(body["reward"])
        return _web().json_response({"session": session.id, "reward": session.reward})

    def _middleware(self, web: Any) -> Any:
        """Every refusal and failure as OpenAI's error JSON, one line, never a traceback."""

        @web.middleware
        async def errors(request: Any, handler: Any) -> Any:
            try:
                return await handler(request)
            except CaptureError as exc:
                return web.json_response(exc.body(), status=exc.status)
            except web.HTTPException as exc:  # no such route, wrong method, body too large
                if exc.status == 404:
                    msg = f"no route {request.method} {request.path}; the capture endpoint serves {ROUTES}"
                elif exc.status == 405:
                    msg = f"{request.method} is not allowed on {request.path}; the capture endpoint serves {ROUTES}"
                elif exc.status == 413:
                    msg = f"the request body is over {self._max_request_bytes} bytes"
                else:
                    msg = exc.reason or f"HTTP {exc.status}"
                return web.json_response(CaptureError(exc.status, msg).body(), status=exc.status)
            except Exception as exc:  # a bug here: logged with its traceback, one line to the agent
                log.exception("capture endpoint: internal error")
                err = CaptureError(500, f"internal error in the capture endpoint: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}", type="server_error")
                return web.json_response(err.body(), status=500)

        return errors

    # -- the request

    def _common(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise CaptureError(404, f"the model {model!r} is not served here; use model={self.model!r}",
                               param="model", code="model_not_found")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise bad(f"stream must be true or false, got {stream!r}", "stream")
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise bad("stream_options is only allowed with stream=true", "stream_options")
            if not isinstance(options, Mapping) or not isinstance(options.get("include_usage", False), bool):
                raise bad("stream_options must be an object like {\"include_usage\": true}", "stream_options")
        for key in ("n", "best_of"):
            n = body.get(key)
            if n is not None and n != 1:
                raise bad(f"{key}={n!r} is not supported: the capture endpoint returns one choice per call; "
                          "make separate calls (or sessions)", key)

    @staticmethod
    def parse_stream(body: dict[str, Any]) -> bool | None:
        """None: answer with one JSON body; else stream it, True: with the usage chunk (after :meth:`_common`)."""
        if not body.get("stream"):
            return None
        return bool((body.get("stream_options") or {}).get("include_usage", False))

    def parse_completion(self, body: dict[str, Any]) -> TextCall:
        """A ``/completions`` body as a :class:`TextCall`, or the :class:`CaptureError` refusing it."""
        if "prompt" not in body:
            raise bad("missing 'prompt': send the text (or a list of token ids) to complete", "prompt")
        self._common(body)
        for key in ("echo", "suffix"):
            if body.get(key):
                raise bad(f"{key} is not supported by the capture endpoint", key)
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 1):
            raise bad(f"logprobs={logprobs!r} is not supported: 0 or 1 gives the sampled tokens' log-probs "
                      "(no alternatives)", "logprobs")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        text = ids = None
        if isinstance(prompt, str) and prompt:
            text = prompt
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            ids = list(prompt)
        else:
            raise bad("'prompt' must be one non-empty string or one non-empty list of token ids "
                      "(one prompt per call)", "prompt")
        sampling, overridden, clamped = self._sampling(body)
        return TextCall(prompt_text=text, prompt_ids=ids, sampling=sampling, logprobs=logprobs is not None,
                        overridden=overridden, clamped=clamped)

    def parse_chat(self, body: dict[str, Any]) -> ChatCall:
        """A chat request's body as a :class:`ChatCall`, or the :class:`CaptureError` (400/404) refusing it."""
        if "messages" not in body:
            raise bad("missing 'messages': send the conversation as a list of {role, content} objects", "messages")
        self._common(body)
        if body.get("top_logprobs"):
            raise bad("top_logprobs is not supported; use logprobs=true for the sampled tokens' log-probs",
                      "top_logprobs")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise bad(f"tool_choice={choice!r} is not supported (the model cannot be forced to call a tool); "
                      "use 'auto' or 'none'", "tool_choice")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
            raise bad("response_format other than text is not supported (no constrained decoding)",
                      "response_format")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list)
                                  or not all(isinstance(t, Mapping) and t.get("type") == "function" for t in tools)):
            raise bad("'tools' must be a list of {type: 'function', function: {...}} objects", "tools")
        messages = normalize_messages(body["messages"])
        sampling, overridden, clamped = self._sampling(body)
        return ChatCall(messages=messages, tools=tools or None, sampling=sampling, logprobs=bool(body.get("logprobs")),
                        parse_tools=bool(tools) and choice != "none", overridden=overridden, clamped=clamped)

    def _sampling(self, body: dict[str, Any]) -> tuple[SamplingParams, bool, bool]:
        base = _fields(self.sampling)
        out = dict(base)
        clamped = overridden = False
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"{key} must be a whole number >= 1, got {value!r}", key)
            clamped = value > base["max_new_tokens"]
            out["max_new_tokens"] = min(value, base["max_new_tokens"])
            break
        for key, field in (("temperature", "temperature"), ("top_p", "top_p")):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(f"{key} must be a number, got {value!r}", key)
            if not self.honor_agent_sampling:
                overridden = overridden or float(value) != float(base[field])
                continue
            if key == "temperature" and value <= 0:
                raise bad("temperature must be > 0 (use a small value for near-greedy sampling)", key)
            if key == "top_p" and not 0 < value <= 1:
                raise bad(f"top_p must be in (0, 1], got {value!r}", key)
            out[field] = float(value)
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise bad(f"seed must be an integer, got {seed!r}", "seed")
            out["seed"] = seed
        stop = body.get("stop")
        if stop is not None:
            words = [stop] if isinstance(stop, str) else stop
            if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
                raise bad("stop must be a string or a list of strings", "stop")
            ids = list(out["stop_token_ids"])
            for word in words:
                enc = self.renderer.encode(word)
                if len(enc) != 1:
                    raise bad(f"stop {word!r} is {len(enc)} tokens; the capture endpoint stops on single tokens only "
                              "(the model's end-of-turn token is always a stop)", "stop")
                ids.append(enc[0])
            out["stop_token_ids"] = tuple(dict.fromkeys(ids))
        return SamplingParams(**out), overridden, clamped


def _fields(sampling: SamplingParams) -> dict[str, Any]:
    return {k: getattr(sampling, k) for k in SamplingParams.__dataclass_fields__}
