"""``sglang`` rollout engine: the RolloutEngine contract over an SGLang server's HTTP API.

One replica = one SGLang server, used by this engine alone. What each method
sends (routes and bodies as in SGLang's ``http_server.py`` / ``io_struct.py``):

- ``generate``: one ``POST /generate`` per request, ``{"rid", "input_ids",
  "sampling_params", "return_logprob": true}``; tokens and log-probs come from
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples),
  the finish reason from ``meta_info.finish_reason.type`` (stop / length /
  abort). Results are yielded as the answers arrive (completion order).
- ``abort``: ``POST /abort_request {"rid"}``; an abort can overtake the request
  it names, so an aborted request whose answer is still missing is aborted
  again (``abort_retry_s``, doubling, up to 1 s).
- ``pause``: ``POST /pause_generation {"mode": "abort" | "in_place" |
  "retract"}``; ``resume``: ``POST /continue_generation``. While paused or
  updating, new requests wait here (none is sent).
- ``update_weights``: every bucket is received and verified first (a bad one
  leaves the server untouched), then in-flight requests finish (the safe
  point: no completion mixes versions), then per bucket ``POST
  /update_weights_from_distributed`` while this process broadcasts the tensors
  to the server's ranks (mode ``distributed``), or ``POST
  /update_weights_from_tensor`` with CUDA IPC handles (mode ``tensor``), then
  ``POST /update_weight_version`` and ``POST /flush_cache``.
- ``sleep`` / ``wake_up``: ``/release_memory_occupation`` /
  ``/resume_memory_occupation`` (the server needs ``--enable-memory-saver``).
- ``health``: ``GET /health``; ``start`` checks ``GET /get_server_info``.

Versions: every token of a completion carries the version the engine had when
it sent the request (updates wait for in-flight requests, so a completion
never spans two versions); a resumed prefix keeps its own versions. The
server's ``meta_info.weight_version`` is kept in the result's metadata.

Failures: a 4xx/5xx answer to one ``/generate`` fails that request alone
(finish reason ``error``, the server's message in ``error``); a lost
connection, or a timeout or 5xx after which ``/health`` does not answer,
fails the engine: ``EngineError`` out of every ``generate`` iterator, and
every later call raises it.
"""

from __future__ import annotations

import asyncio
import base64
import io
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
from asyncflow_sglang.config import SGLangRolloutConfig, parse_version

log = logging.getLogger(__name__)

#: SGLang versions whose /pause_generation takes a mode (older ones always abort)
PAUSE_MODES_SINCE = (0, 5, 6)


@dataclass(eq=False)
class _Req:
    """One request's state while it is in flight on this engine."""

    request: GenerationRequest
    queue: asyncio.Queue
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    sent: bool = False  #: its /generate went out (the server may be working on it)
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
        self._server_version: str | None = None
        self._inflight: dict[str, _Req] = {}
        self._changed = asyncio.Event()  # set whenever a request finishes or the gate opens
        self._paused: PauseMode | None = None
        self._updating = False
        self._asleep = False
        self._failure: EngineError | None = None
        self._group: Any = None  # torch.distributed group of the distributed weight sync
        self._group_name = f"asyncflow-{uuid.uuid4().hex[:12]}"
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
        self._client = SGLangClient(
            url, connect_timeout_s=cfg.connect_timeout_s, max_connections=cfg.max_connections, api_key=cfg.api_key
        )
        try:
            await self._check_server()
        except BaseException:
            await self._close()
            raise

    async def _check_server(self) -> None:
        cfg = self.config
        info = await self._control("GET", "/get_server_info")
        version = str(info.get("version", "")) if isinstance(info, dict) else ""
        parsed = parse_version(version)
        if parsed is None:
            raise EngineError(
                f"{self.url}/get_server_info did not report an SGLang version (got {version!r}); is this an "
                "SGLang server?"
            )
        self._server_version = version
        if parsed < parse_version(cfg.min_server_version):  # type: ignore[operator]
            raise EngineError(
                f"SGLang {version} at {self.url} is older than min_server_version {cfg.min_server_version}; "
                "upgrade the server"
            )
        if cfg.pause_keep and parsed < PAUSE_MODES_SINCE:
            raise EngineError(
                f"SGLang {version} at {self.url} has no /pause_generation modes (0.5.6 and later have them), so "
                "pause(keep) would abort; upgrade the server or set pause_keep: false"
            )
        if isinstance(info, dict) and info.get("is_generation") is False:
            raise EngineError(f"the model served at {self.url} is not a generation model")
        if isinstance(info, dict) and info.get("weight_version") is not None:
            self._versions_by_name[str(info["weight_version"])] = self._version

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
            await self._client.get("/health", timeout_s=self.config.control_timeout_s)
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
            done, pending = await asyncio.wait(tasks, timeout=self.config.control_timeout_s)
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
                    pass  # older servers have no such route; the group dies with the server
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
            q = _Req(r, queue)
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
            sent = [q.request.request_id for q in left if q.sent]
            if sent and self._failure is None and self._client is not None:
                self._spawn(self._abort_quietly(sent))

    def _invalid(self, r: GenerationRequest) -> str | None:
        """Why this engine will not serve ``r`` (its ERROR result), or None."""
        sp = r.sampling
        if (sp.top_p < 1.0 or sp.top_k > 0) and self.config.truncated_logprobs == "refuse":
            return (
                f"top_p={sp.top_p}, top_k={sp.top_k}: SGLang returns log-probs of the temperature-scaled "
                "distribution without renormalising after top-k/top-p, which is not asyncflow's log-prob "
                "convention; sample with top_p=1 and top_k=-1, or set rollout.options.truncated_logprobs: server "
                "to accept SGLang's values"
            )
        return None

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
        await self._admitted(q)
        if q.abort.is_set():
            return _result(q, [], [], FinishReason.ABORT)
        client = self._check_usable()
        q.version = self._version
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens - len(prefix),
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "stop_token_ids": list(sp.stop_token_ids),
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        payload = {
            "rid": r.request_id,
            "input_ids": [*r.prompt_token_ids, *prefix],
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
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
            await self._abort_quietly([r.request_id])
            await self._require_alive(exc)
            return _result(q, [], [], FinishReason.ERROR, str(exc))
        finally:
            if not call.done():
                call.cancel()
        return self._parse(q, body)

    async def _await_answer(self, q: _Req, call: asyncio.Future) -> None:
        """Wait for the /generate answer; once aborted, abort it on the server until the answer comes."""
        wait_abort = asyncio.ensure_future(q.abort.wait())
        try:
            await asyncio.wait({call, wait_abort}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wait_abort.cancel()
        delay = self.config.abort_retry_s
        while not call.done():
            await asyncio.wait({call}, timeout=delay)
            if not call.done():
                # the first abort may have reached the server before this request did
                await self._abort_quietly([q.request.request_id])
                delay = min(delay * 2, 1.0)

    def _parse(self, q: _Req, body: Any) -> GenerationResult:
        rid = q.request.request_id
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        meta = body.get("meta_info") if isinstance(body, dict) else None
        if not isinstance(meta, dict):
            return _result(q, [], [], FinishReason.ERROR,
                           f"/generate answer for {rid!r} has no meta_info: {str(body)[:300]}")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            return _result(q, [], [], FinishReason.ERROR,
                           f"/generate answer for {rid!r} has no meta_info.output_token_logprobs (was "
                           "return_logprob honoured?)")
        try:
            tokens = [int(t[1]) for t in triples]
            logprobs = [float(t[0]) for t in triples]
        except (TypeError, ValueError, IndexError):
            return _result(q, [], [], FinishReason.ERROR,
                           f"meta_info.output_token_logprobs for {rid!r} are not [logprob, token_id, text] triples")
        ids = body.get("output_ids")
        if isinstance(ids, list) and [int(t) for t in ids] != tokens:
            return _result(q, [], [], FinishReason.ERROR,
                           f"/generate answer for {rid!r}: output_ids and output_token_logprobs disagree")
        q.weight_version = meta.get("weight_version")
        if q.weight_version is not None:
            known = self._versions_by_name.get(str(q.weight_version))
            if known is not None:
                # a request the server held while paused ran on whatever weights it had then: its answer says which
                q.version = known
            else:
                log.warning("SGLang answered %r with weight_version %r, which this engine never set; labelling its "
                            "tokens with version %d", rid, q.weight_version, q.version)
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind == "stop":
            return _result(q, tokens, logprobs, FinishReason.STOP)
        if kind == "length":
            return _result(q, tokens, logprobs, FinishReason.LENGTH)
        if kind == "abort" and q.abort.is_set():
            return _result(q, tokens, logprobs, FinishReason.ABORT)
        message = reason.get("message") if isinstance(reason, dict) else None
        return _result(q, tokens, logprobs, FinishReason.ERROR,
                       f"SGLang ended {rid!r} with finish_reason {reason!r}" + (f": {message}" if message else ""))

    async def _require_alive(self, cause: ServerError) -> None:
        """After a timeout or a 5xx: a server that still answers /health failed this request only."""
        try:
            await self._client.get("/health", timeout_s=self.config.control_timeout_s)  # type: ignore[union-attr]
        except ServerError as exc:
            raise EngineError(f"{cause} and then /health failed too ({exc}); the server is down") from cause

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

    def _admitting(self) -> bool:
        return self._paused is None and not self._updating and not self._asleep

    async def _admitted(self, q: _Req) -> None:
        while not self._admitting() and not q.abort.is_set():
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
        except asyncio.TimeoutError:
            raise EngineError(f"{what}: the engine stayed asleep for {timeout_s:g}s; call wake_up() first") from None

    async def _until(self, predicate: Any) -> None:
        while not predicate():
            if self._failure is not None:
                raise self._failure
            self._changed.clear()
            await self._changed.wait()

    async def _drain(self, timeout_s: float, what: str) -> None:
        """Wait until no sent request is in flight on the server."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(q.sent for q in self._inflight.values()):
            if self._failure is not None:
                raise self._failure
            left = deadline - loop.time()
            if left <= 0:
                raise EngineError(f"{what}: {sum(q.sent for q in self._inflight.values())} requests were still "
                                  f"running on the SGLang server after {timeout_s:g}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
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
            q.abort.set()
        sent = [q.request.request_id for q in targets if q.sent]
        if sent:
            await self._abort_on_server(sent)
        return [q.request.request_id for q in targets]

    async def _abort_on_server(self, rids: list[str]) -> None:
        client = self._check_usable()
        timeout = self.config.control_timeout_s
        await asyncio.gather(*(client.post("/abort_request", {"rid": rid}, timeout_s=timeout) for rid in rids))

    async def _abort_quietly(self, rids: list[str]) -> None:
        """Abort on the server, ignoring failures (the request's own call reports a dead server)."""
        try:
            await self._abort_on_server(rids)
        except EngineError:
            pass

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        mode = PauseMode(mode)
        if mode is PauseMode.KEEP and not self._features.supports_pause_keep:
            raise UnsupportedFeatureError("pause(keep) needs pause_keep: true (and SGLang >= 0.5.6)")
        self._check_usable()
        previous, self._paused = self._paused, mode
        try:
            if mode is PauseMode.WAIT:
                await self._drain(self.config.control_timeout_s, "pause(wait)")
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
        if self._paused is PauseMode.KEEP and any(q.sent for q in self._inflight.values()):
            raise UnsupportedFeatureError(
                "update_weights while requests are held by pause(keep) needs supports_inflight_weight_update, "
                "which the sglang engine does not offer (a held completion would mix versions it cannot label); "
                "pause with abort, or resume first"
            )
        # every bucket verified before anything reaches the server (it checks names and shapes against its model)
        received = await collect_update(version, buckets)
        await self._awake(self.config.weight_sync.drain_timeout_s, f"update to version {version}")
        self._updating = True
        try:
            if self._paused is None:
                # the safe point: no request of ours runs while the weights change, so none spans two versions
                # (paused, the server samples nothing, and SGLang applies an update at once)
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
        loaded = 0
        try:
            for bucket in buckets:
                if self.config.weight_sync.mode == "distributed":
                    await self._send_distributed(bucket, version)
                else:
                    await self._send_tensor(bucket, version)
                loaded += 1
            self._versions_by_name[str(version)] = version
            await self._control("POST", "/update_weight_version",
                                {"new_version": str(version), "abort_all_requests": False})
            await self._control("POST", "/flush_cache", {})
        except EngineError as exc:
            self._versions_by_name.pop(str(version), None)
            error = EngineError(
                f"the update to version {version} failed after {loaded} of {len(buckets)} buckets were sent "
                f"({exc}); the server may now hold a mix of two versions (SGLang loads tensors as they arrive) "
                "and the weight-update group is in an unknown state: restart the server"
            )
            self._fail(error)
            raise error from exc
        self._version = version

    async def _send_distributed(self, bucket: WeightBucket, version: int) -> None:
        from asyncflow_sglang import weight_group

        sync = self.config.weight_sync
        group = await self._weight_group()
        device = self._broadcast_device()
        tensors = [t.to(device) if t.device != device else t for _, t in bucket.tensors()]
        payload = {
            "names": [m.name for m in bucket.metas],
            "dtypes": [m.dtype for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas],
            "group_name": self._group_name,
            "flush_cache": False,
            "abort_all_requests": False,
        }
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
            if isinstance(exc, ServerAnswerError):
                raise
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"broadcasting bucket {bucket.index} of version {version} to the SGLang server "
                              f"failed: {type(exc).__name__}: {exc}") from exc

    async def _weight_group(self) -> Any:
        if self._group is not None:
            return self._group
        from asyncflow_sglang import weight_group

        sync = self.config.weight_sync
        world = 1 + self.config.server_world_size
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

    async def _send_tensor(self, bucket: WeightBucket, version: int) -> None:
        """Colocated mode: the tensors stay on this process's GPU; the server maps them by CUDA IPC handle."""
        device = self._broadcast_device()
        # kept alive until the server has answered: it maps these very allocations
        named = [(n, t.to(device) if t.device != device else t) for n, t in bucket.tensors()]
        payload = {
            "serialized_named_tensors": [serialize_named_tensors(named)] * self.config.server_world_size,
            "load_format": None,
            "flush_cache": False,
            "abort_all_requests": False,
        }
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
        self._asleep = True
        try:
            # in-flight requests finish first (their memory is what gets released)
            await self._drain(self.config.control_timeout_s, "sleep()")
        except BaseException:
            self._asleep = False
            self._changed.set()
            raise
        tags = ["kv_cache"] if level == 1 else ["kv_cache", "weights"]
        try:
            await self._control("POST", "/release_memory_occupation", {"tags": tags})
        except BaseException:
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
        await self._control("POST", "/resume_memory_occupation", {"tags": None})
        self._asleep = False
        self._changed.set()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)`` format: base64 of a
    ``ForkingPickler`` dump (CUDA tensors travel as IPC handles, not bytes)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import init_reductions

    init_reductions()  # torch's tensor and storage reductions (CUDA IPC handles) on ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _result(
    q: _Req, tokens: list[int], logprobs: list[float], reason: FinishReason, error: str | None = None
) -> GenerationResult:
    r = q.request
    metadata = dict(r.metadata)
    if q.weight_version is not None:
        metadata["sglang_weight_version"] = q.weight_version
    return GenerationResult(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        token_ids=(*r.prefix_token_ids, *tokens),
        logprobs=(*r.prefix_logprobs, *logprobs),
        versions=(*r.prefix_versions, *([q.version] * len(tokens))),
        finish_reason=reason,
        error=error,
        metadata=metadata,
    )
