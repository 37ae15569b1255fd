"""``sglang`` rollout engine: the RolloutEngine contract over an SGLang server's HTTP API.

One replica = one SGLang server (0.5.20 to 0.5.23), used by this engine alone.
What each method sends (routes and bodies as in SGLang's ``http_server.py`` /
``io_struct.py``; the rules as pure functions in :mod:`asyncflow_sglang.protocol`):

- ``generate``: one ``POST /generate`` per request, ``{"rid", "input_ids",
  "sampling_params", "return_logprob": true}`` (plus ``return_sampling_mask``
  for top-k requests); the ``rid`` is this engine's own, fixed-length, unique
  per send (SGLang aborts every rid that *starts with* the one named).
  Tokens and log-probs come from ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]`` triples) or, renormalised, from
  ``output_token_sampling_logprobs``; the finish reason from
  ``meta_info.finish_reason.type`` (stop / length / abort); per-token versions
  from the ``meta_info.weight_versions`` spans. Results are yielded as the
  answers arrive (completion order).
- ``abort``: unsent requests end here; for a sent one, one ``POST
  /abort_request {"rid"}`` (SGLang forwards one abort per request and drops one
  for a rid it does not know yet). An aborted request whose answer is still
  missing after ``abort_retry_s`` may have been held where that abort could
  not reach it (on its way, or waiting out a pause): once every request of
  this engine on the server is aborted, ``{"abort_all": true}`` goes out,
  again after doubling delays, until the answers are back (no new request is
  sent meanwhile, so none of them can be caught).
- ``pause``: ``POST /pause_generation {"mode": "abort" | "in_place" |
  "retract"}``; ``resume``: ``POST /continue_generation``. While paused or
  updating, new requests wait here (none is sent).
- ``update_weights``: every bucket is received and verified first (a bad one
  leaves the server untouched), then in-flight requests finish (the safe
  point), then, on SGLang >= 0.5.21, ``POST /begin_weight_update``; per bucket
  ``POST /update_weights_from_distributed`` while this process broadcasts the
  tensors to the server's ranks (mode ``distributed``), or ``POST
  /update_weights_from_tensor`` with CUDA IPC handles (mode ``tensor``), the
  last one carrying ``weight_version``; then ``POST /end_weight_update`` and
  ``POST /flush_cache``.
- ``sleep`` / ``wake_up``: ``/release_memory_occupation`` /
  ``/resume_memory_occupation`` of exactly the tags released (the server needs
  ``--enable-memory-saver``).
- ``health``: ``GET /model_info`` (answered by SGLang's tokenizer manager alone:
  no generation probe, unaffected by a pause or an update); ``start`` reads
  ``GET /server_info`` and ``GET /model_info``.

Versions: a token carries the version of the weights that sampled it, from
the answer's ``weight_versions`` spans (the engine names every version it
installs ``str(version)``); a resumed prefix keeps its own versions.

Failures: a 4xx/5xx answer to one ``/generate`` fails that request alone
(finish reason ``error``, the server's message in ``error``); a lost
connection, or a timeout or 5xx after which ``/model_info`` does not answer,
fails the engine: ``EngineError`` out of every ``generate`` iterator, and
every later call raises it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core.errors import EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine, RolloutFeatures
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, WeightBucket, collect_update
from asyncflow_sglang.client import (
    ServerAnswerError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    SGLangClient,
)
from asyncflow_sglang.config import SGLangRolloutConfig
from asyncflow_sglang.protocol import (
    ServerFacts,
    answer_tokens,
    refusal,
    renormalised,
    serialize_named_tensors,
    server_facts,
    span_versions,
)

log = logging.getLogger(__name__)

__all__ = ["SGLangRolloutEngine", "serialize_named_tensors"]


@dataclass(eq=False)
class _Req:
    """One request's state while it is in flight on this engine."""

    request: GenerationRequest
    queue: asyncio.Queue
    rid: str = ""  #: the rid sent to the server (this engine's own; fixed length, so no rid prefixes another)
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    sent: bool = False  #: its /generate went out (the server may be working on it)
    abort_posted: bool = False  #: its one /abort_request went out
    order: int = 0  #: when it was submitted, among this engine's requests
    got_tokens: list[int] = field(default_factory=list)  #: earlier segments (a completion the model's EOS cut)
    got_logprobs: list[float] = field(default_factory=list)
    got_versions: list[int] = field(default_factory=list)
    done: bool = False
    version: int = 0
    task: asyncio.Task | None = None
    weight_version: Any = None  #: the server's meta_info.weight_version of the answer


class SGLangRolloutEngine(RolloutEngine):
    """An SGLang server behind the RolloutEngine contract (see the module docstring)."""

    def __init__(self, config: SGLangRolloutConfig) -> None:
        self.config = config
        self._features = config.features()
        self._version = 0
        self._client: SGLangClient | None = None
        self._server: Any = None  # launch.ServerProcess when this engine started the server
        self._facts: ServerFacts | None = None
        self._inflight: dict[str, _Req] = {}
        self._changed = asyncio.Event()  # set whenever a request finishes or the gate opens
        self._paused: PauseMode | None = None
        self._updating = False
        self._asleep = False
        self._released: list[str] = []  # memory tags released by sleep(), resumed by wake_up()
        self._failure: EngineError | None = None
        self._group: Any = None  # torch.distributed group of the distributed weight sync
        self._group_name = f"asyncflow-{uuid.uuid4().hex[:12]}"
        self._rid_prefix = f"asyncflow-{uuid.uuid4().hex[:12]}-"
        self._sends = itertools.count()
        self._orders = itertools.count()  # submission order of requests (pause(wait) lets earlier ones finish)
        self._wait_cutoff = 0
        self._sweep: asyncio.Task | None = None  # abort_all until every aborted request has answered
        self._sweeping = False  # an abort_all may be on its way: no new request is sent
        self._background: set[asyncio.Task] = set()
        self._shut = False
        # the server's weight_version strings and the engine versions they stand for
        self._versions_by_name: dict[str, int] = {}
        self._installing: asyncio.Future | None = None  # the weight update being sent, if any

    # -- lifecycle --------------------------------------------------------------

    @property
    def features(self) -> RolloutFeatures:
        return self._features

    @property
    def version(self) -> int:
        return self._version

    @property
    def url(self) -> str | None:
        """The server's base URL (``None`` before ``start`` when launching)."""
        return self._client.base_url if self._client is not None else self.config.url

    async def start(self) -> None:
        if self._client is not None:
            return
        cfg = self.config
        url = cfg.url
        if cfg.launch is not None:
            from asyncflow_sglang.launch import start_server

            self._server = await start_server(cfg)
            url = self._server.url
        assert url is not None
        self._client = SGLangClient(url, connect_timeout_s=cfg.connect_timeout_s, max_connections=cfg.max_connections,
                                    api_key=cfg.api_key, admin_api_key=cfg.admin_api_key, keepalive_s=cfg.keepalive_s)
        try:
            info = await self._control("GET", "/server_info")
            model = await self._control("GET", "/model_info")
            self._facts = server_facts(url, info, model, cfg)
        except BaseException:
            await self._close()
            raise
        if self._facts.weight_version is not None:
            self._versions_by_name[self._facts.weight_version] = self._version

    def _check_usable(self) -> SGLangClient:
        if self._shut:
            raise EngineError("the sglang rollout engine was shut down")
        if self._failure is not None:
            raise self._failure
        if self._client is None:
            raise EngineError("call start() before using the sglang rollout engine")
        return self._client

    async def health(self) -> Health:
        if self._shut:
            return Health(ok=False, detail="shut down")
        if self._failure is not None:
            return Health(ok=False, detail=str(self._failure))
        if self._client is None:
            return Health(ok=False, detail="not started")
        try:
            # not /health: that route generates a token (1 s at least; 503 after 20 s while paused or updating)
            await self._client.get("/model_info", timeout_s=self.config.control_timeout_s)
        except ServerError as exc:
            return Health(ok=False, detail=str(exc), in_flight=len(self._inflight))
        state = "paused" if self._paused is not None else "asleep" if self._asleep else ""
        return Health(ok=True, detail=state, in_flight=len(self._inflight))

    async def shutdown(self) -> None:
        if self._shut:
            return
        if self._installing is not None and not self._installing.done():
            # an update whose caller was cancelled (the run stopping) finishes first: the server must not be
            # left between versions, and the version it ends at must be recorded there
            await asyncio.wait({self._installing}, timeout=self.config.weight_sync.group_timeout_s)
        self._shut = True
        reqs = list(self._inflight.values())
        for q in reqs:
            q.abort.set()
        if self._client is not None and self._failure is None:
            try:
                if any(q.sent for q in reqs):
                    await self._client.post("/abort_request", {"rid": "", "abort_all": True},
                                            timeout_s=self.config.control_timeout_s)
                if self._paused not in (None, PauseMode.WAIT):
                    # leave a server someone else started as it was found: generating
                    await self._client.post("/continue_generation", {}, timeout_s=self.config.control_timeout_s)
            except ServerError:
                pass  # the server is gone already; the requests end with the engine
        tasks = [q.task for q in reqs if q.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.config.control_timeout_s)
            for t in pending:
                t.cancel()
        for t in list(self._background):
            t.cancel()
        await self._close()

    async def _close(self) -> None:
        if self._group is not None:
            from asyncflow_sglang import weight_group

            if self._client is not None and self._failure is None:
                try:
                    await self._client.post("/destroy_weights_update_group", {"group_name": self._group_name},
                                            timeout_s=self.config.control_timeout_s)
                except ServerError:
                    pass  # the server is gone; the group dies with it
            weight_group.destroy(self._group)
            self._group = None
        if self._client is not None:
            await self._client.close()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None

    # -- generate ---------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        self._check_usable()
        requests = list(requests)
        ids = [r.request_id for r in requests]
        dupes = {i for i in ids if ids.count(i) > 1} | (set(ids) & set(self._inflight))
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {sorted(dupes)}")
        queue: asyncio.Queue = asyncio.Queue()
        mine: list[_Req] = []
        for r in requests:
            q = _Req(r, queue, order=next(self._orders))
            problem = self._invalid(r)
            if problem is not None:
                q.done = True
                queue.put_nowait(_result(q, [], [], FinishReason.ERROR, problem))
                continue
            self._inflight[r.request_id] = q
            mine.append(q)
            q.task = asyncio.ensure_future(self._run(q))
        remaining = len(requests)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= 1
                yield item
        finally:
            # the consumer left early, or an error ends the stream: nobody wants the rest
            left = [q for q in mine if not q.done]
            for q in left:
                q.done = True
                if q.task is not None:
                    q.task.cancel()
                self._forget(q)
            sent = [q for q in left if q.sent]
            if sent and self._failure is None and self._client is not None:
                self._spawn(self._abort_quietly(sent))

    def _invalid(self, r: GenerationRequest) -> str | None:
        """Why this engine will not serve ``r`` (its ERROR result), or None."""
        assert self._facts is not None
        return refusal(r.sampling, self._facts, self.config)

    async def _run(self, q: _Req) -> None:
        """Serve one request; deliver its result (or the engine's failure) to its generate call."""
        try:
            result = await self._serve(q)
        except asyncio.CancelledError:
            self._forget(q)
            raise
        except EngineError as exc:
            self._fail(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug here must end the stream with a reason, not hang it
            self._fail(EngineError(f"the sglang rollout engine failed on {q.request.request_id!r}: "
                                   f"{type(exc).__name__}: {exc}"))
            return
        if not q.done:
            q.done = True
            self._forget(q)
            q.queue.put_nowait(result)

    async def _serve(self, q: _Req) -> GenerationResult:
        r = q.request
        sp = r.sampling
        stop = set(sp.stop_token_ids) | set(self.config.eos_token_ids)
        prefix = list(r.prefix_token_ids)
        if prefix and prefix[-1] in stop:
            return _result(q, [], [], FinishReason.STOP)
        if len(prefix) >= sp.max_new_tokens:
            return _result(q, [], [], FinishReason.LENGTH)
        while True:
            await self._admitted(q)
            if q.abort.is_set():
                return _result(q, [], [], FinishReason.ABORT)
            outcome = await self._send(q, prefix)
            if isinstance(outcome, GenerationResult):
                return outcome
            tokens, logprobs, versions, reason = outcome
            made = len(prefix) + len(q.got_tokens) + len(tokens)
            if reason is FinishReason.STOP and tokens and tokens[-1] not in stop:
                # SGLang also ends at the model's own EOS (it checks stop_token_ids and EOS together; ignore_eos
                # turns off both), but only the request's stop ids end an asyncflow completion: go on after it
                if made >= sp.max_new_tokens:
                    return _result(q, tokens, logprobs, FinishReason.LENGTH, versions=versions)
                q.got_tokens += tokens
                q.got_logprobs += logprobs
                q.got_versions += versions
                q.sent = q.abort_posted = False
                self._changed.set()
                continue
            return _result(q, tokens, logprobs, reason, versions=versions)

    async def _send(self, q: _Req, prefix: list[int]) -> GenerationResult | tuple[Any, ...]:
        """One /generate for the rest of ``q``: its parsed segment, or the request's ERROR result."""
        r = q.request
        sp = r.sampling
        client = self._check_usable()
        q.version = self._version
        q.rid = f"{self._rid_prefix}{next(self._sends):012d}"
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens - len(prefix) - len(q.got_tokens),
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "stop_token_ids": sorted(set(sp.stop_token_ids) | set(self.config.eos_token_ids)),
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        payload = {
            "rid": q.rid,
            "input_ids": [*r.prompt_token_ids, *prefix, *q.got_tokens],
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if renormalised(sp, self.config):
            payload["return_sampling_mask"] = True  # "selected" mode: the sampled token's renormalised log-prob
        q.sent = True
        call = asyncio.ensure_future(client.post("/generate", payload, timeout_s=self.config.request_timeout_s))
        try:
            await self._await_answer(q, call)
            body = call.result()
        except ServerAnswerError as exc:
            if exc.status is not None and exc.status >= 500:
                await self._require_alive(exc)
            return _result(q, [], [], FinishReason.ERROR, str(exc))
        except ServerTimeoutError as exc:
            await self._abort_quietly([q])
            await self._require_alive(exc)
            return _result(q, [], [], FinishReason.ERROR, str(exc))
        finally:
            if not call.done():
                call.cancel()
        return self._parse(q, body)

    async def _await_answer(self, q: _Req, call: asyncio.Future) -> None:
        """Wait for the /generate answer; once aborted, make sure the abort reaches the server."""
        wait_abort = asyncio.ensure_future(q.abort.wait())
        try:
            await asyncio.wait({call, wait_abort}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wait_abort.cancel()
        if call.done():
            return
        await self._abort_quietly([q])
        await asyncio.wait({call}, timeout=self.config.abort_retry_s)
        if not call.done():
            # SGLang dropped the abort (the rid was unknown to it yet) or forwarded it before its scheduler held
            # the request; a second abort by rid is ignored, so abort_all takes over once it is safe
            self._start_sweep()
            await asyncio.wait({call})

    def _start_sweep(self) -> None:
        if self._sweep is None or self._sweep.done():
            self._sweep = asyncio.ensure_future(self._abort_all_until_answered())
            self._background.add(self._sweep)
            self._sweep.add_done_callback(self._background.discard)

    async def _abort_all_until_answered(self) -> None:
        """``abort_all`` (which SGLang never de-duplicates) while every request of ours on the server is aborted
        and some have not answered; new requests wait meanwhile, so the sweep cannot catch one."""
        delay = self.config.abort_retry_s
        try:
            while self._failure is None and self._client is not None:
                pending = [q for q in self._inflight.values() if q.sent and not q.done]
                stuck = [q for q in pending if q.abort.is_set()]
                if not stuck:
                    return
                self._sweeping = len(stuck) == len(pending)
                if self._sweeping:
                    try:
                        await self._client.post("/abort_request", {"rid": "", "abort_all": True},
                                                timeout_s=self.config.control_timeout_s)
                    except ServerError:
                        pass  # a dead server fails the requests' own calls
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), delay)
                except TimeoutError:
                    pass
                delay = min(delay * 2, 1.0)
        finally:
            self._sweeping = False
            self._changed.set()

    def _parse(self, q: _Req, body: Any) -> GenerationResult | tuple[Any, ...]:
        """An answer's (tokens, log-probs, versions, finish reason), or the request's ERROR result."""
        rid = q.request.request_id
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        meta = body.get("meta_info") if isinstance(body, dict) else None
        if not isinstance(meta, dict):
            return _result(q, [], [], FinishReason.ERROR,
                           f"/generate answer for {rid!r} has no meta_info: {str(body)[:300]}")
        try:
            tokens, logprobs = answer_tokens(meta, body.get("output_ids"),
                                             renormalise=renormalised(q.request.sampling, self.config))
        except ValueError as exc:
            return _result(q, [], [], FinishReason.ERROR, f"/generate answer for {rid!r}: {exc}")
        q.weight_version = meta.get("weight_version")
        versions = self._token_versions(q, span_versions(meta.get("weight_versions"), len(tokens)), len(tokens))
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind == "stop":
            return tokens, logprobs, versions, FinishReason.STOP
        if kind == "length":
            return tokens, logprobs, versions, FinishReason.LENGTH
        if kind == "abort" and q.abort.is_set():
            return tokens, logprobs, versions, FinishReason.ABORT
        message = reason.get("message") if isinstance(reason, dict) else None
        return _result(q, tokens, logprobs, FinishReason.ERROR,
                       f"SGLang ended {rid!r} with finish_reason {reason!r}" + (f": {message}" if message else ""),
                       versions=versions)

    def _token_versions(self, q: _Req, names: list[str] | None, count: int) -> list[int]:
        """Engine versions of the answer's tokens: per span, else the answer's weight_version, else the version
        when the request was sent (a name this engine never set is logged and read as the latter)."""
        if names is None:
            if q.weight_version is None:
                return [q.version] * count
            names = [str(q.weight_version)] * count
        versions = []
        for name in names:
            known = self._versions_by_name.get(name)
            if known is None:
                log.warning("SGLang answered %r with weight version %r, which this engine never set; labelling "
                            "its tokens with version %d", q.request.request_id, name, q.version)
                known = q.version
            versions.append(known)
        return versions

    async def _require_alive(self, cause: ServerError) -> None:
        """After a timeout or a 5xx: a server that still answers /model_info failed this request only."""
        try:
            await self._client.get("/model_info", timeout_s=self.config.control_timeout_s)  # type: ignore[union-attr]
        except ServerError as exc:
            raise EngineError(f"{cause} and then /model_info failed too ({exc}); the server is down") from cause

    def _fail(self, exc: EngineError) -> None:
        """An engine-wide failure: every open generate call ends with ``exc``; later calls raise it."""
        if self._failure is None:
            self._failure = exc
            log.error("sglang rollout engine at %s failed: %s", self.url, exc)
        queues: dict[int, asyncio.Queue] = {}
        for q in list(self._inflight.values()):
            queues[id(q.queue)] = q.queue
            q.done = True
            if q.task is not None and q.task is not asyncio.current_task():
                q.task.cancel()
        self._inflight.clear()
        for queue in queues.values():
            queue.put_nowait(self._failure)
        self._changed.set()

    def _forget(self, q: _Req) -> None:
        if self._inflight.get(q.request.request_id) is q:
            del self._inflight[q.request.request_id]
            self._changed.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- admission gate ---------------------------------------------------------

    def _admitting(self, q: _Req) -> bool:
        if self._updating or self._asleep or self._sweeping:
            return False
        # pause(wait) lets the requests submitted before it run to their end; later ones wait for resume()
        return self._paused is None or (self._paused is PauseMode.WAIT and q.order < self._wait_cutoff)

    async def _admitted(self, q: _Req) -> None:
        while not self._admitting(q) and not q.abort.is_set():
            self._changed.clear()
            waiter = asyncio.ensure_future(self._changed.wait())
            aborted = asyncio.ensure_future(q.abort.wait())
            try:
                await asyncio.wait({waiter, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                aborted.cancel()

    async def _awake(self, timeout_s: float, what: str) -> None:
        """Wait for ``wake_up`` (the server's memory is released while asleep: nothing may be loaded into it)."""
        try:
            await asyncio.wait_for(self._until(lambda: not self._asleep), timeout_s)
        except TimeoutError:
            raise EngineError(f"{what}: the engine stayed asleep for {timeout_s:g}s; call wake_up() first") from None

    async def _until(self, predicate: Any) -> None:
        while not predicate():
            if self._failure is not None:
                raise self._failure
            self._changed.clear()
            await self._changed.wait()

    async def _drain(self, timeout_s: float, what: str, *, before: int | None = None) -> None:
        """Wait until no sent request is in flight on the server (``before``: nor any request submitted before
        that order, sent or not)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def busy() -> list[_Req]:
            return [q for q in self._inflight.values() if q.sent or (before is not None and q.order < before)]

        while busy():
            if self._failure is not None:
                raise self._failure
            left = deadline - loop.time()
            if left <= 0:
                raise EngineError(f"{what}: {len(busy())} requests were still running on the SGLang server after "
                                  f"{timeout_s:g}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    # -- abort / pause ------------------------------------------------------------

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        if not self._features.supports_abort:
            raise UnsupportedFeatureError("the sglang rollout engine was built without abort support")
        self._check_usable()
        if request_ids is None:
            targets = [q for q in self._inflight.values() if not q.abort.is_set()]
        else:
            targets = [self._inflight[i] for i in dict.fromkeys(request_ids)
                       if i in self._inflight and not self._inflight[i].abort.is_set()]
        for q in targets:
            q.abort.set()  # an unsent request ends here, never reaching the server
        sent = [q for q in targets if q.sent]
        if sent:
            await self._abort_on_server(sent)
        return [q.request.request_id for q in targets]

    async def _abort_on_server(self, reqs: list[_Req]) -> None:
        """One /abort_request per request: SGLang forwards the first abort of a rid and ignores the rest."""
        client = self._check_usable()
        timeout = self.config.control_timeout_s
        todo = [q for q in reqs if not q.abort_posted]
        for q in todo:
            q.abort_posted = True
        await asyncio.gather(*(client.post("/abort_request", {"rid": q.rid}, timeout_s=timeout) for q in todo))

    async def _abort_quietly(self, reqs: list[_Req]) -> None:
        """Abort on the server, ignoring failures (the request's own call reports a dead server)."""
        try:
            await self._abort_on_server(reqs)
        except EngineError:
            pass

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        if mode is PauseMode.KEEP and not self._features.supports_pause_keep:
            raise UnsupportedFeatureError("pause(keep) needs pause_keep: true")
        self._check_usable()
        previous, self._paused = self._paused, mode
        try:
            if mode is PauseMode.WAIT:
                self._wait_cutoff = next(self._orders)
                await self._drain(self.config.control_timeout_s, "pause(wait)", before=self._wait_cutoff)
            elif mode is PauseMode.ABORT:
                for q in self._inflight.values():
                    q.abort.set()
                # the server aborts what it runs and holds what arrives later: no token is sampled until
                # /continue_generation (the aborted answers come out of generate as they arrive)
                await self._control("POST", "/pause_generation", {"mode": "abort"})
            else:
                await self._control("POST", "/pause_generation", {"mode": self.config.keep_mode})
        except BaseException:
            if self._failure is None and previous is None and mode is not PauseMode.ABORT:
                # the server did not pause: admit requests again (after an abort-pause the server may be paused)
                self._paused = None
                self._changed.set()
            raise

    async def resume(self) -> None:
        if self._paused is None:
            return
        self._check_usable()
        if self._paused is not PauseMode.WAIT:
            await self._control("POST", "/continue_generation", {})
        self._paused = None
        self._changed.set()

    async def _control(self, method: str, route: str, payload: dict[str, Any] | None = None) -> Any:
        """A control call; a failure of it is a failure of the engine (it no longer knows the server's state)."""
        client = self._check_usable()
        try:
            if method == "GET":
                return await client.get(route, timeout_s=self.config.control_timeout_s)
            return await client.post(route, payload, timeout_s=self.config.control_timeout_s)
        except ServerUnreachableError as exc:
            self._fail(exc)
            raise

    # -- weights ---------------------------------------------------------------------

    def configure_adapter(self, spec: Any) -> None:
        """Refused: this adapter does not drive SGLang's LoRA endpoints (see docs/adapters/sglang.md, LoRA)."""
        raise UnsupportedFeatureError(
            "the sglang rollout engine does not apply LoRA adapter updates yet (supports_adapter_updates=False): "
            "unset trainer.lora to train the full model, or use the vllm or torch rollout engine for LoRA"
        )

    async def update_weights(
        self,
        version: int,
        buckets: AsyncIterable[WeightBucket],
        *,
        kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE,
    ) -> None:
        try:
            kv_cache = KVCachePolicy(kv_cache)
        except ValueError:
            choices = [p.value for p in KVCachePolicy]
            raise ValueError(f"unknown kv_cache policy {kv_cache!r}; use one of {choices}") from None
        self._check_usable()
        if (self._paused is PauseMode.KEEP and self._inflight
                and not self._features.supports_inflight_weight_update):
            raise UnsupportedFeatureError(
                "update_weights while requests are held by pause(keep) needs supports_inflight_weight_update, which "
                "the sglang engine offers only with keep_mode: retract (in_place keeps the old weights' KV cache, "
                "and SGLang refuses to flush it while requests are held); pause with abort, or resume first"
            )
        # every bucket verified before anything reaches the server (it checks names and shapes against its model)
        received = await collect_update(version, buckets)
        await self._awake(self.config.weight_sync.drain_timeout_s, f"update to version {version}")
        self._updating = True
        try:
            if self._paused is None:
                # the safe point: no request of ours runs while the weights change, so none spans two versions
                # (paused, the server samples nothing, and a held request's weight_versions spans tell which
                # weights sampled which of its tokens)
                await self._drain(self.config.weight_sync.drain_timeout_s, f"update to version {version}")
            # runs to the end even if the caller is cancelled: the server's weights and `version` never disagree
            self._installing = asyncio.ensure_future(self._install(version, received))
            # a caller cancelled mid-update never reads the outcome; the engine's own state records a failure
            self._installing.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.shield(self._installing)
        finally:
            self._updating = False
            self._changed.set()

    async def _install(self, version: int, buckets: list[WeightBucket]) -> None:
        """Begin the update session (SGLang >= 0.5.21), send every bucket (the last one names the version), end
        the session, flush the cache. Nothing is loaded before the session is open, and every bucket's receiving
        request is posted before its broadcast starts."""
        assert self._facts is not None
        session = self._facts.update_session
        distributed = self.config.weight_sync.mode == "distributed"
        if distributed:
            try:
                await self._weight_group()  # formed before the session opens
            except EngineError as exc:
                # the server's ranks may still sit in the rendezvous (SGLang gives them no deadline of ours)
                self._fail(exc)
                raise
        if session:
            # a refusal leaves the weights as they were (nothing was loaded): the engine stays usable
            await self._control("POST", "/begin_weight_update", {})
        loaded = 0
        opened = session
        try:
            self._versions_by_name[str(version)] = version  # the last bucket sets it on the server
            for bucket in buckets:
                name = str(version) if bucket is buckets[-1] else None
                if distributed:
                    await self._send_distributed(bucket, version, name)
                else:
                    await self._send_tensor(bucket, name)
                loaded += 1
            if session:
                opened = False
                await self._control("POST", "/end_weight_update", {})
            await self._flush_cache()
        except EngineError as exc:
            if opened:
                await self._end_session_quietly()
            self._versions_by_name.pop(str(version), None)
            error = EngineError(
                f"the update to version {version} failed after {loaded} of {len(buckets)} buckets were sent "
                f"({exc}); the server may now hold a mix of two versions (SGLang loads tensors as they arrive) "
                "and the weight-update group is in an unknown state: restart the server"
            )
            self._fail(error)
            raise error from exc
        self._version = version

    async def _end_session_quietly(self) -> None:
        """Close a session a failed update opened (best effort), so the server does not keep it open."""
        if self._client is None:
            return
        try:
            await self._client.post("/end_weight_update", {}, timeout_s=self.config.control_timeout_s)
        except ServerError:
            pass

    async def _flush_cache(self) -> None:
        """/flush_cache, again while it answers 400: SGLang refuses to flush while any request is queued or running,
        which a /health probe from elsewhere (a generation) can be for a second or more."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.control_timeout_s
        delay = 0.05
        while True:
            try:
                await self._control("POST", "/flush_cache", {})
                return
            except ServerAnswerError as exc:
                if exc.status != 400 or loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _send_distributed(self, bucket: WeightBucket, version: int, weight_version: str | None) -> None:
        from asyncflow_sglang import weight_group

        sync = self.config.weight_sync
        group = await self._weight_group()
        device = self._broadcast_device()
        # moved before the request goes out: a local failure must come before the server posts its receives
        tensors = [t.to(device) if t.device != device else t for _, t in bucket.tensors()]
        payload: dict[str, Any] = {
            "names": [m.name for m in bucket.metas],
            "dtypes": [m.dtype for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas],
            "group_name": self._group_name,
            "flush_cache": False,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        # the request announces the tensors; the server posts one receive per tensor, in this order
        call = asyncio.ensure_future(self._client.post(  # type: ignore[union-attr]
            "/update_weights_from_distributed", payload, timeout_s=sync.group_timeout_s))
        send = asyncio.ensure_future(asyncio.to_thread(weight_group.broadcast, tensors, group))
        try:
            await asyncio.wait({call, send}, return_when=asyncio.FIRST_EXCEPTION)
            if call.done() and call.exception() is not None and not send.done():
                # the server refused before receiving: the broadcast can only time out, and a timed-out
                # group is unusable, so the engine is done either way
                raise call.exception()  # type: ignore[misc]
            await send
            await call
        except Exception as exc:
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"broadcasting bucket {bucket.index} of version {version} to the SGLang server "
                              f"failed: {type(exc).__name__}: {exc}") from exc

    async def _weight_group(self) -> Any:
        if self._group is not None:
            return self._group
        from asyncflow_sglang import weight_group

        sync = self.config.weight_sync
        world = 1 + self._facts.tp_size  # type: ignore[union-attr]  # SGLang's ranks are rank_offset + tp_rank
        store = await asyncio.to_thread(weight_group.host_store, sync.master_address, world, sync.group_timeout_s)
        init_method = f"tcp://{sync.master_address}:{store.port}"
        payload = {
            "master_address": sync.master_address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": self._group_name,
            "backend": sync.backend,
        }
        call = asyncio.ensure_future(self._client.post(  # type: ignore[union-attr]
            "/init_weights_update_group", payload, timeout_s=sync.group_timeout_s))
        join = asyncio.ensure_future(asyncio.to_thread(
            weight_group.join, backend=sync.backend, init_method=init_method, rank=0, world_size=world,
            group_name=self._group_name, timeout_s=sync.group_timeout_s, store=store))
        try:
            await asyncio.wait({call, join}, return_when=asyncio.FIRST_EXCEPTION)
            if call.done() and call.exception() is not None:
                raise call.exception()  # type: ignore[misc]
            self._group = await join
            await call
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"could not form the weight-update group with the SGLang server at {self.url} "
                              f"({sync.backend} on {init_method}): {type(exc).__name__}: {exc}") from exc
        return self._group

    def _broadcast_device(self) -> torch.device:
        sync = self.config.weight_sync
        if sync.device != "auto":
            return torch.device(sync.device)
        return torch.device("cuda" if sync.backend == "nccl" else "cpu")

    async def _send_tensor(self, bucket: WeightBucket, weight_version: str | None) -> None:
        """Colocated mode: the tensors stay on this process's GPU; the server maps them by CUDA IPC handle."""
        assert self._facts is not None
        device = self._broadcast_device()
        # kept alive until the server has answered: it maps these very allocations
        named = [(n, t.to(device) if t.device != device else t) for n, t in bucket.tensors()]
        payload: dict[str, Any] = {
            # one payload per TP rank, each serialised on its own (a rank maps only its own copy: SGLang's
            # deserialize_own_rank), GPUs named by UUID as SGLang's senders name them
            "serialized_named_tensors": [serialize_named_tensors(named) for _ in range(self._facts.tp_size)],
            "load_format": None,
            "flush_cache": False,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        await self._client.post("/update_weights_from_tensor", payload,  # type: ignore[union-attr]
                                timeout_s=self.config.weight_sync.group_timeout_s)

    # -- sleep ---------------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        if not self._features.supports_sleep:
            raise UnsupportedFeatureError(
                "sleep() needs a server started with --enable-memory-saver; set memory_saver: true"
            )
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep weights) or 2 (drop weights), got {level}")
        self._check_usable()
        if self._paused is PauseMode.KEEP and any(q.sent for q in self._inflight.values()):
            raise EngineError("sleep() while pause(keep) holds requests on the server: SGLang releases memory only "
                              "when idle (it asserts so and would crash); resume them or pause with abort first")
        self._asleep = True
        try:
            # in-flight requests finish first (their memory is what gets released)
            await self._drain(self.config.control_timeout_s, "sleep()")
            wanted = ["kv_cache"] if level == 1 else ["kv_cache", "weights"]
            # a tag released twice would be paused twice by the memory saver: release only what is not yet
            tags = [t for t in wanted if t not in self._released]
            if tags:
                await self._control("POST", "/release_memory_occupation", {"tags": tags})
                self._released += tags
        except BaseException:
            if not self._released:
                self._asleep = False
                self._changed.set()
            raise

    async def wake_up(self) -> None:
        if not self._features.supports_sleep:
            raise UnsupportedFeatureError(
                "wake_up() needs a server started with --enable-memory-saver; set memory_saver: true"
            )
        self._check_usable()
        if not self._asleep:
            return
        if self._released:
            # exactly the tags released: SGLang resumes every tag named (null names all of them) and removes each
            # from its offload set, so a tag never released raises in its scheduler and takes the server down
            await self._control("POST", "/resume_memory_occupation", {"tags": list(self._released)})
            self._released = []
        self._asleep = False
        self._changed.set()


def _result(
    q: _Req,
    tokens: list[int],
    logprobs: list[float],
    reason: FinishReason,
    error: str | None = None,
    *,
    versions: list[int] | None = None,
) -> GenerationResult:
    r = q.request
    metadata = dict(r.metadata)
    if q.weight_version is not None:
        metadata["sglang_weight_version"] = q.weight_version
    return GenerationResult(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        token_ids=(*r.prefix_token_ids, *q.got_tokens, *tokens),
        logprobs=(*r.prefix_logprobs, *q.got_logprobs, *logprobs),
        versions=(*r.prefix_versions, *q.got_versions,
                  *(versions if versions is not None else [q.version] * len(tokens))),
        finish_reason=reason,
        error=error,
        metadata=metadata,
    )
