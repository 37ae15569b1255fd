"""``sim`` rollout engine: continuous batching simulated event by event on the loop's clock.

Between two events (an arrival, a completion, an abort, a weight update, a
pause) the running batch is constant, so every running sequence gains one
token per decoding step of fixed duration ``step_time(batch)``. The engine
therefore sleeps straight to the next completion — ``remaining tokens of the
shortest x step_time`` — instead of stepping token by token, and when
something interrupts it, it finishes the decoding step in progress (the safe
point) and re-plans. A replica with 256 sequences of 2k tokens costs a few
hundred events, not half a million steps.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import heapq
import math
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import EngineError, WeightTransferError
from asyncflow_core.interfaces import Health, KVCachePolicy, PauseMode, RolloutEngine, RolloutFeatures
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, WeightBucket
from asyncflow_core.types.generation import with_version_range
from asyncflow_plugins.sim.host import SimHost, SimHostShare, host_for
from asyncflow_plugins.sim.latency import ResponseLengths, RolloutLatency
from asyncflow_plugins.sim.policy import cyclic_slice, logprob_buffer, request_uniform, token_buffer

FEATURES = RolloutFeatures(
    supports_abort=True,
    supports_resume_prefix=True,
    supports_pause_keep=True,
    supports_pause_abort=True,
    supports_inflight_weight_update=True,
    supports_sleep=True,
    weight_transports=("sim", "inprocess"),
)

#: Request metadata key that fixes a request's total response length (prefix included), for tests.
LENGTH_METADATA_KEY = "sim_response_length"

_EPS = 1e-9


class SimRolloutConfig(BaseModel):
    """Options of the ``sim`` rollout engine."""

    model_config = ConfigDict(extra="forbid")

    latency: RolloutLatency = Field(default_factory=RolloutLatency, description="Cost model of one replica.")
    lengths: ResponseLengths = Field(default_factory=ResponseLengths, description="Response length distribution.")
    seed: int = Field(0, description="Seed of response lengths and token ids (with the request id: deterministic).")
    policy_seed: int = Field(0, description="Seed of the simulated policy's log-probs (use the sim trainer's).")
    vocab_size: int = Field(32000, ge=2, description="Token ids are drawn below this.")
    time_scale: float = Field(
        1.0, gt=0, description="Loop seconds per modelled second; < 1 makes runs on a real event loop fast (tests)."
    )
    payload: Literal["tokens", "lengths"] = Field(
        "tokens",
        description="What results carry: tokens (token ids and log-probs, for testing the store and trainers) or "
        "lengths (zero-width token ids and log-probs, real per-token versions; the same schedule, far less work at "
        "scale; asyncflow sim's default).",
    )
    machine: SimHostShare | None = Field(
        None, description="Share a simulated machine's cores with the other sim engines that name the same host "
        "(processor sharing: prefill and decoding slow down while they run; docs/simulation.md). None: the "
        "replica has its own devices.")


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    owner: _Inbox
    offset: int  # where this request's tokens start in the shared token buffer
    prompt_len: int
    prefix_len: int
    target: int  # total response tokens, resumed prefix included
    capped: bool  # target was cut at max_new_tokens (finish reason ``length``)
    reserve: int  # KV tokens reserved while running
    state: str = "waiting"  # waiting -> running -> done
    admit_step: int = 0  # engine step count at admission; tokens come from steps admit_step+1 ...
    finish_step: int = 0
    aborted: bool = False
    cancelled: bool = False  # the generate() iterator that owns it is gone: drop silently


@dataclass
class SimRolloutStats:
    """Counters of one replica (modelled seconds, i.e. not multiplied by ``time_scale``)."""

    busy_seconds: float = 0.0  #: prefilling or decoding
    prefill_seconds: float = 0.0  #: of busy_seconds, prefill (admissions and KV recomputes)
    overhead_seconds: float = 0.0  #: sleep / wake_up
    steps: int = 0  #: decoding steps
    tokens_generated: int = 0  #: new tokens (resumed prefixes excluded)
    prefill_tokens: int = 0
    finished: int = 0  #: results with reason stop or length
    aborted: int = 0
    errors: int = 0
    events: int = 0  #: scheduler intervals (a measure of simulation cost)
    weight_updates: int = 0
    batch_token_seconds: float = field(default=0.0, repr=False)  #: integral of the running batch over decode time


class SimRolloutEngine(RolloutEngine):
    """A simulated inference replica (see the module docstring for the model).

    Attributes the runtime can read: :attr:`devices` (accelerators it
    occupies), :attr:`busy_seconds`, :attr:`stats` (:class:`SimRolloutStats`),
    :attr:`num_running`, :attr:`num_waiting`.
    """

    def __init__(self, config: SimRolloutConfig | None = None) -> None:
        self.config = config or SimRolloutConfig()
        self._lat = self.config.latency
        self._scale = self.config.time_scale
        self.stats = SimRolloutStats()
        self._version = 0
        # version log: steps numbered from 1; steps >= _log_steps[i] use _log_versions[i]
        self._log_steps: list[int] = [1]
        self._log_versions: list[int] = [0]
        self._steps = 0
        self._inflight: dict[str, _Seq] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._heap: list[tuple[int, int, _Seq]] = []
        self._admitted = 0  # tie-break counter for the heap
        self._n_running = 0
        self._kv_used = 0
        self._to_abort: list[_Seq] = []
        self._updates: list[tuple[int, KVCachePolicy, asyncio.Future]] = []
        self._pending_stall = 0.0
        self._pending_stall_tokens = 0
        self._paused = False
        self._pause_requested = False
        self._poke: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._accepting: asyncio.Event | None = None
        self._quiescent: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._asleep = 0
        self._shut = False
        self._failure: BaseException | None = None
        self._tokens: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self._host: SimHost | None = None

    # -- properties -------------------------------------------------------------
    @property
    def features(self) -> RolloutFeatures:
        return FEATURES

    @property
    def version(self) -> int:
        return self._version

    @property
    def devices(self) -> int:
        """Accelerators this replica occupies."""
        return self._lat.devices_per_replica

    @property
    def busy_seconds(self) -> float:
        """Modelled seconds spent prefilling or decoding."""
        return self.stats.busy_seconds

    @property
    def num_running(self) -> int:
        return self._n_running

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self._waiting if s.state == "waiting")

    # -- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        if self._shut:
            raise EngineError("the sim rollout engine was shut down; build a new one")
        if self._task is not None:
            return
        c = self.config
        self._tokens = token_buffer(c.policy_seed, c.vocab_size)
        self._host = host_for(c.machine) if c.machine is not None else None
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._quiescent = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task = asyncio.get_running_loop().create_task(self._schedule(), name="sim-rollout-scheduler")
        self._task.add_done_callback(self._scheduler_done)

    def _check_started(self) -> None:
        if self._shut:
            raise EngineError("the sim rollout engine was shut down")
        if self._task is None:
            raise EngineError("call start() before using the sim rollout engine")
        if self._failure is not None:
            raise EngineError(f"the sim rollout scheduler failed: {self._failure!r}") from self._failure

    async def shutdown(self) -> None:
        if self._shut or self._task is None:
            self._shut = True
            return
        for seq in list(self._inflight.values()):
            self._mark_abort(seq)
        self._poke_scheduler()
        if self._failure is None and self._inflight:
            assert self._idle is not None
            await self._idle.wait()
        self._shut = True
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        assert self._accepting is not None
        self._accepting.set()  # generate() calls blocked on a pause see the shutdown

    async def health(self) -> Health:
        if self._shut:
            return Health(ok=False, detail="shut down")
        if self._task is None:
            return Health(ok=False, detail="not started")
        if self._failure is not None:
            return Health(ok=False, detail=f"scheduler failed: {self._failure!r}")
        detail = "asleep" if self._asleep else ("paused" if self._paused else "")
        return Health(ok=True, detail=detail, in_flight=len(self._inflight))

    # -- generate -----------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        # an async iterator object, not an async generator: the loop's first-iteration hook adds every async
        # generator to a WeakSet, and a run makes one generate call per request (~135k at 1,024 devices).
        # Everything happens on the first iteration, as in an async generator's body.
        return _Generation(self, requests)

    def _open(self, requests: Sequence[GenerationRequest], queue: _Inbox) -> list[_Seq] | None:
        """The first iteration of a generate() call: check the call and submit the requests; None when the engine
        is paused (then :meth:`_open_paused` waits for the resume and submits). No coroutine on the usual path."""
        self._check_started()
        inflight = self._inflight
        if len(requests) == 1:  # the runtime's usual call: one request, no set to build
            ids = [requests[0].request_id]
            dupes = set(ids) if ids[0] in inflight else set()
        else:
            ids = [r.request_id for r in requests]
            dupes = {i for i in ids if i in inflight}
            if len(set(ids)) < len(ids):
                dupes |= {i for i, n in collections.Counter(ids).items() if n > 1}
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {sorted(dupes)}")
        if self._asleep:
            raise EngineError("the sim rollout engine is asleep; call wake_up() before generate()")
        assert self._accepting is not None
        if not self._accepting.is_set():  # paused: the caller waits for the resume
            return None
        return self._submit_all(requests, queue)

    async def _open_paused(self, requests: Sequence[GenerationRequest], queue: _Inbox) -> list[_Seq]:
        """:meth:`_open` of a call made while paused: wait for the resume, check again, submit."""
        assert self._accepting is not None
        await self._accepting.wait()
        self._check_started()
        dupes = {r.request_id for r in requests if r.request_id in self._inflight}
        if dupes:
            raise ValueError(f"duplicate request ids in flight: {sorted(dupes)}")
        return self._submit_all(requests, queue)

    def _submit_all(self, requests: Sequence[GenerationRequest], queue: _Inbox) -> list[_Seq]:
        mine = [self._submit(r, queue) for r in requests]
        if self._could_admit():
            self._poke_scheduler()
        return mine

    def _drop(self, mine: list[_Seq]) -> None:
        """A generate() call's consumer went away before its last result: free the slots its requests hold."""
        for seq in mine:
            if seq.state != "done":
                seq.cancelled = True
                self._mark_abort(seq)
        self._poke_scheduler()

    def _submit(self, request: GenerationRequest, owner: _Inbox) -> _Seq:
        c = self.config
        # a seeded request draws from its seed and prompt (same seed and prompt, same tokens and length, in any
        # call), others from their id
        seed = request.sampling.seed
        key = request.request_id if seed is None else f"\x01seed:{seed}:{','.join(map(str, request.prompt_token_ids))}"
        u, offset = request_uniform(c.seed, key)
        prefix_len = len(request.prefix_token_ids)
        cap = request.sampling.max_new_tokens
        fixed = request.metadata.get(LENGTH_METADATA_KEY)
        if prefix_len >= cap:
            target, capped = prefix_len, True
        elif fixed is not None:
            target = max(int(fixed), prefix_len + 1)
            target, capped = (cap, True) if target >= cap else (target, False)
        else:
            target, capped = c.lengths.draw(u, cap, longer_than=prefix_len)
        prompt_len = len(request.prompt_token_ids)
        seq = _Seq(request, owner, offset, prompt_len, prefix_len, target, capped, reserve=prompt_len + target)
        self._inflight[request.request_id] = seq
        assert self._idle is not None
        self._idle.clear()
        prompt = request.prompt_token_ids
        if prompt and not _in_vocab(prompt, c.vocab_size):
            bad = [t for t in prompt if not 0 <= t < c.vocab_size][:5]
            self._finish(seq, 0, error=f"prompt token ids {bad} are outside the vocabulary of {c.vocab_size} "
                                       "(vocab_size of the sim engine)")
        elif target <= prefix_len:  # nothing left to generate
            self._finish(seq, 0)
        elif seq.reserve > self._lat.kv_capacity_tokens:
            self._finish(
                seq,
                0,
                error=(
                    f"prompt ({prompt_len}) + response ({target}) tokens exceed the replica's KV capacity of "
                    f"{self._lat.kv_capacity_tokens} tokens; raise latency.kv_tokens_per_device or "
                    "devices_per_replica, or lower max_new_tokens"
                ),
            )
        else:
            self._waiting.append(seq)
        return seq

    # -- results ------------------------------------------------------------------
    def _finish(self, seq: _Seq, new_tokens: int, *, error: str | None = None) -> None:
        """Deliver ``seq``'s result (``new_tokens`` generated since admission) to its generate() iterator."""
        seq.state = "done"
        self._inflight.pop(seq.request.request_id, None)
        if not self._inflight:
            assert self._idle is not None
            self._idle.set()
        if seq.cancelled:
            return
        if error is not None:
            reason = FinishReason.ERROR
            self.stats.errors += 1
        elif seq.aborted:
            reason = FinishReason.ABORT
            self.stats.aborted += 1
        else:
            reason = FinishReason.LENGTH if seq.capped else FinishReason.STOP
            self.stats.finished += 1
        seq.owner.put_nowait(self._result(seq, new_tokens, reason, error))

    def _result(self, seq: _Seq, new: int, reason: FinishReason, error: str | None) -> GenerationResult:
        """The result as 1-D tensors (int64 ids, float32 log-probs, int64 versions), built without per-token Python.

        In the usual case (no resumed prefix, one weight version, no wrap)
        ``token_ids`` and ``logprobs`` are *views* of the cached buffers of
        :mod:`~asyncflow_plugins.sim.policy`, shared by every engine of the
        same policy: consumers must not modify them in place (the runtime's
        packing copies them). Copying here costs ~20% of engine-only time.
        """
        r = seq.request
        lengths_only = self.config.payload == "lengths"
        if lengths_only and new and not seq.prefix_len:  # the usual lengths-only result: one stamp if one version
            first = seq.admit_step + 1
            steps = self._log_steps
            i = bisect.bisect_right(steps, first) - 1
            if i + 1 == len(steps) or steps[i + 1] > seq.admit_step + new:
                v = self._log_versions[i]
                token_ids, logprobs = self._no_values(new)
                return with_version_range(GenerationResult(
                    request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=token_ids,
                    logprobs=logprobs, versions=self._stamp(v, new), finish_reason=reason, error=error,
                    metadata=r.metadata), v, v)
        start = seq.offset + seq.prefix_len
        ids: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        vers: list[torch.Tensor] = []
        lo = hi = None  # the version range, known without scanning the tensors
        if seq.prefix_len:  # a resumed request: its earlier tokens come first
            vers.append(torch.as_tensor(r.prefix_versions, dtype=torch.int64))
            lo, hi = min(r.prefix_versions), max(r.prefix_versions)
            if not lengths_only:
                ids.append(torch.as_tensor(r.prefix_token_ids, dtype=torch.int64))
                lps.append(torch.as_tensor(r.prefix_logprobs, dtype=torch.float32))
        if new:
            c = self.config
            if not lengths_only:
                ids.append(cyclic_slice(self._tokens, start, new))
            first, last = seq.admit_step + 1, seq.admit_step + new
            i = bisect.bisect_right(self._log_steps, first) - 1
            done = 0
            while done < new:  # one segment per weight version the tokens were sampled under
                run_end = self._log_steps[i + 1] - 1 if i + 1 < len(self._log_steps) else last
                count = min(run_end, last) - (first + done) + 1
                v = self._log_versions[i]
                if count > 0:
                    lo = v if lo is None or v < lo else lo
                    hi = v if hi is None or v > hi else hi
                if lengths_only:  # a stride-0 view: one int64 whatever the length
                    vers.append(self._stamp(v, count))
                else:
                    vers.append(torch.full((count,), v, dtype=torch.int64))
                    lps.append(cyclic_slice(logprob_buffer(c.policy_seed, c.vocab_size, v), start + done, count))
                done += count
                i += 1
        if lengths_only:
            # zero-width values: the ragged columns they land in keep offsets (the lengths) and no data
            token_ids, logprobs = self._no_values(seq.prefix_len + new)
        else:
            token_ids, logprobs = _join(ids, torch.int64), _join(lps, torch.float32)
        return with_version_range(GenerationResult(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=token_ids,
            logprobs=logprobs,
            versions=_join(vers, torch.int64),
            finish_reason=reason,
            error=error,
            metadata=r.metadata,
        ), lo, hi)

    @staticmethod
    def _stamp(version: int, count: int) -> torch.Tensor:
        """``count`` copies of ``version`` as a stride-0 int64 view, cached per version and count and shared by
        every engine (lengths-only results of one length and version share it; nobody writes into a result)."""
        key = (version, count)
        view = _STAMPS.get(key)
        if view is None:
            base = _STAMPS.get(version)
            if base is None:
                base = torch.tensor([version], dtype=torch.int64)
            if len(_STAMPS) >= _CACHE_MAX:
                _STAMPS.clear()
            _STAMPS[version] = base
            view = _STAMPS[key] = base.expand(count)
        return view

    def _no_values(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-width token ids and log-probs of ``total`` rows (cached per length, shared between results)."""
        pair = _NO_VALUES.get(total)
        if pair is None:
            if len(_NO_VALUES) >= _CACHE_MAX:
                _NO_VALUES.clear()
            pair = _NO_VALUES[total] = (_NO_IDS.expand(total, 0), _NO_LOGPROBS.expand(total, 0))
        return pair

    # -- abort / pause / resume -------------------------------------------------------
    def _mark_abort(self, seq: _Seq) -> None:
        if seq.state != "done" and not seq.aborted:
            seq.aborted = True
            self._to_abort.append(seq)

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        self._check_started()
        if request_ids is None:
            targets = [s for s in self._inflight.values() if not s.aborted]
        else:
            targets = [self._inflight[i] for i in dict.fromkeys(request_ids) if i in self._inflight]
            targets = [s for s in targets if not s.aborted]
        for seq in targets:
            self._mark_abort(seq)
        if targets:
            self._poke_scheduler()
        return [s.request.request_id for s in targets]

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._check_started()
        mode = PauseMode(mode)
        assert self._accepting is not None and self._idle is not None and self._quiescent is not None
        if self._paused:
            if mode is PauseMode.ABORT:
                await self.abort(None)
                await self._idle.wait()
            elif mode is PauseMode.WAIT and self._inflight:
                raise EngineError("pause(WAIT) on an engine paused with requests held would never return; resume first")
            return
        self._accepting.clear()
        if mode is PauseMode.ABORT:
            await self.abort(None)
        elif mode is PauseMode.WAIT:
            await self._idle.wait()
        self._quiescent.clear()
        self._pause_requested = True
        self._poke_scheduler()
        await self._quiescent.wait()
        if mode is PauseMode.ABORT and self._inflight:
            await self._idle.wait()

    async def resume(self) -> None:
        self._check_started()
        self._pause_requested = False
        if self._paused:
            self._paused = False
            self._poke_scheduler()
        assert self._accepting is not None
        self._accepting.set()

    # -- weights ------------------------------------------------------------------------
    async def update_weights(
        self, version: int, buckets: AsyncIterable[WeightBucket], *, kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE
    ) -> None:
        self._check_started()
        kv_cache = KVCachePolicy(kv_cache)
        count, last = 0, False
        async for bucket in buckets:
            bucket.verify()
            if bucket.version != version:
                raise WeightTransferError(f"bucket of version {bucket.version} in an update to version {version}")
            if bucket.index != count:
                raise WeightTransferError(f"bucket index {bucket.index} where {count} was expected (version {version})")
            count += 1
            last = bucket.last
        if not count or not last:
            raise WeightTransferError(
                f"update to version {version} ended after {count} bucket(s) without the last one; weights unchanged"
            )
        done = asyncio.get_running_loop().create_future()
        self._updates.append((version, kv_cache, done))
        self._poke_scheduler()
        await done  # applied by the scheduler at the next safe point (between decoding steps)

    # -- sleep / wake ------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        self._check_started()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep weights on host) or 2 (drop them), got {level}")
        if self._inflight:
            raise EngineError(
                f"sleep() needs an idle engine, {len(self._inflight)} request(s) are in flight; "
                "pause(WAIT) or pause(ABORT) first"
            )
        if self._asleep:
            return
        await self._spend(self._lat.sleep_s)
        self._asleep = level

    async def wake_up(self) -> None:
        self._check_started()
        if not self._asleep:
            return
        await self._spend(self._lat.wake_up_s if self._asleep == 1 else self._lat.wake_up_level2_s)
        self._asleep = 0

    async def _spend(self, seconds: float) -> None:
        await self._busy(seconds)
        self.stats.overhead_seconds += seconds

    async def _busy(self, seconds: float) -> None:
        """Spend ``seconds`` of modelled work without interruption (longer on a shared, busy host)."""
        if self._host is None:
            await asyncio.sleep(seconds * self._scale)
        else:
            share = self.config.machine
            assert share is not None
            await self._host.spend(seconds, share.demand, self._scale, thread=share.thread)

    # -- the scheduler --------------------------------------------------------------------
    def _poke_scheduler(self) -> None:
        poke = self._poke
        if poke is not None and not poke.done():
            poke.set_result(True)

    async def _wait_poke(self, seconds: float | None) -> bool:
        """Wait ``seconds`` of modelled time (forever when None); True when poked earlier."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._poke = fut
        handle = None
        if seconds is not None:
            handle = loop.call_at(loop.time() + seconds * self._scale, _resolve, fut)
        try:
            return await fut
        finally:
            self._poke = None
            if handle is not None:
                handle.cancel()

    async def _work_poke(self, host: SimHost, seconds: float) -> tuple[bool, float]:
        """Work ``seconds`` on the shared host unless poked first: (poked, modelled seconds of work done)."""
        fut = asyncio.get_running_loop().create_future()
        self._poke = fut
        share = self.config.machine
        assert share is not None
        act = host.start(seconds, share.demand, self._scale, fut, thread=share.thread)
        try:
            poked = await fut
        finally:
            self._poke = None
            done = host.stop(act)
        return poked, done

    def _scheduler_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._failure = task.exception()
        for seq in list(self._inflight.values()):
            if not seq.cancelled:
                seq.owner.put_nowait(self._failure)
        if self._idle is not None:
            self._idle.set()

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        lat = self._lat
        stats = self.stats
        while True:
            self._safe_point()
            if self._paused:
                assert self._quiescent is not None
                self._quiescent.set()
                await self._wait_poke(None)
                continue
            stall = self._pending_stall + self._admit()
            self._pending_stall = 0.0
            if self._n_running == 0:
                await self._wait_poke(None)
                continue
            heap = self._heap
            while heap[0][2].state != "running":
                heapq.heappop(heap)  # lazily drop aborted sequences
            batch = self._n_running
            step = lat.step_time(batch)
            n = heap[0][0] - self._steps
            t0 = loop.time()
            stats.events += 1
            host = self._host
            if host is None:  # _wait_poke(stall + n * step) inlined: the scheduler's one await per event
                fut = loop.create_future()
                self._poke = fut
                timer = loop.call_at(t0 + (stall + n * step) * self._scale, _resolve, fut)
                try:
                    poked = await fut
                except BaseException:
                    timer.cancel()
                    raise
                finally:
                    self._poke = None
                if poked:
                    timer.cancel()  # (a timer that fired needs no cancel)
                    elapsed = (loop.time() - t0) / self._scale
                else:
                    elapsed = 0.0
            else:  # modelled time is work done, which a busy host slows
                poked, elapsed = await self._work_poke(host, stall + n * step)
            if not poked:
                k = n
            else:
                if elapsed < stall:  # a prefill is not interruptible
                    await self._busy(stall - elapsed)
                    k = 0
                else:
                    x = (elapsed - stall) / step
                    k = min(n, math.floor(x + _EPS))
                    if k < n and x - k > _EPS:  # finish the step in progress: that is the safe point
                        await self._busy((k + 1 - x) * step)
                        k += 1
            stats.busy_seconds += stall + k * step
            stats.prefill_seconds += stall
            stats.steps += k
            stats.tokens_generated += k * batch
            stats.batch_token_seconds += k * step * batch
            self._steps += k
            while heap and heap[0][0] <= self._steps:
                _, _, seq = heapq.heappop(heap)
                if seq.state == "running" and seq.finish_step <= self._steps:
                    self._release(seq)
                    self._finish(seq, seq.target - seq.prefix_len)

    def _could_admit(self) -> bool:
        """Whether the head of the queue fits now (else an arrival need not interrupt the batch)."""
        for seq in self._waiting:
            if seq.state == "waiting":
                lat = self._lat
                return self._n_running < lat.max_running_seqs and self._kv_used + seq.reserve <= lat.kv_capacity_tokens
        return False

    def _release(self, seq: _Seq) -> None:
        self._n_running -= 1
        self._kv_used -= seq.reserve

    def _admit(self) -> float:
        """Start waiting sequences while batch slots and KV capacity allow; returns their prefill time."""
        lat = self._lat
        tokens = 0
        waiting = self._waiting
        while waiting:
            seq = waiting[0]
            if seq.state != "waiting":
                waiting.popleft()
                continue
            if self._n_running >= lat.max_running_seqs or self._kv_used + seq.reserve > lat.kv_capacity_tokens:
                break
            waiting.popleft()
            seq.state = "running"
            seq.admit_step = self._steps
            seq.finish_step = self._steps + seq.target - seq.prefix_len
            self._admitted += 1
            heapq.heappush(self._heap, (seq.finish_step, self._admitted, seq))
            self._n_running += 1
            self._kv_used += seq.reserve
            tokens += seq.prompt_len + seq.prefix_len
        self.stats.prefill_tokens += tokens
        return lat.prefill_time(tokens) if tokens else 0.0

    def _safe_point(self) -> None:
        """Between decoding steps: apply aborts, weight updates and pause requests."""
        if self._to_abort:
            aborted, self._to_abort = self._to_abort, []
            for seq in aborted:
                if seq.state == "running":
                    self._release(seq)
                    self._finish(seq, self._steps - seq.admit_step)
                elif seq.state == "waiting":
                    self._finish(seq, 0)
        while self._updates:
            version, policy, done = self._updates.pop(0)
            if self._log_steps[-1] == self._steps + 1:
                self._log_versions[-1] = version  # two updates at one safe point: the last one wins
            else:
                self._log_steps.append(self._steps + 1)
                self._log_versions.append(version)
            self._version = version
            self.stats.weight_updates += 1
            if policy is KVCachePolicy.RECOMPUTE and self._n_running:
                context = sum(
                    s.prompt_len + s.prefix_len + (self._steps - s.admit_step)
                    for _, _, s in self._heap
                    if s.state == "running" and s.finish_step > self._steps
                )
                self.stats.prefill_tokens += context
                self._pending_stall += self._lat.prefill_time(context)
            if not done.done():
                done.set_result(None)
        if self._pause_requested:
            self._pause_requested = False
            self._paused = True


#: zero-size bases the lengths-only payload expands (a view costs no allocation)
_NO_IDS = torch.empty((1, 0), dtype=torch.int64)
_NO_LOGPROBS = torch.empty((1, 0), dtype=torch.float32)
#: zero-width (ids, log-probs) views per length; they hold no data, so every engine shares them
_NO_VALUES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_CACHE_MAX = 1 << 16  #: entries per view cache (lengths are capped by max_new_tokens: rarely reached)
#: version -> a one-element int64 tensor, and (version, count) -> its stride-0 view of ``count`` elements
_STAMPS: dict[int | tuple[int, int], torch.Tensor] = {}


#: prompts (tuples, so immutable) known to lie inside a vocabulary -> its size: the n samples of a group and the
#: retries of a row send one prompt many times, and a dict hit costs ~1/7 of scanning 512 ids for min and max
_PROMPTS_IN_VOCAB: dict[tuple[int, ...], int] = {}
#: the same by the prompt object's id -> (the prompt, the size): the rollout stage hands a group's rows one tuple, and
#: a lookup by id does not hash 512 ids (a tuple does not cache its hash); the entry holds the prompt alive, so the
#: id is not reused while it lives
_PROMPTS_BY_ID: dict[int, tuple[tuple[int, ...], int]] = {}
_PROMPTS_MAX = 1024  #: entries kept (each holds a prompt alive; the caches are cleared when full)


def _in_vocab(prompt: tuple[int, ...], vocab_size: int) -> bool:
    """Whether every id of ``prompt`` is in ``[0, vocab_size)`` (remembered per prompt for tuples)."""
    cacheable = type(prompt) is tuple
    if cacheable:
        hit = _PROMPTS_BY_ID.get(id(prompt))
        if hit is not None and hit[0] is prompt and hit[1] == vocab_size:
            return True
        if _PROMPTS_IN_VOCAB.get(prompt) == vocab_size:
            _remember(prompt, vocab_size)
            return True
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        return False
    if cacheable:
        _remember(prompt, vocab_size)
    return True


def _remember(prompt: tuple[int, ...], vocab_size: int) -> None:
    if len(_PROMPTS_IN_VOCAB) >= _PROMPTS_MAX or len(_PROMPTS_BY_ID) >= _PROMPTS_MAX:
        _PROMPTS_IN_VOCAB.clear()
        _PROMPTS_BY_ID.clear()
    _PROMPTS_IN_VOCAB[prompt] = vocab_size
    _PROMPTS_BY_ID[id(prompt)] = (prompt, vocab_size)


class _Generation:
    """The async iterator of one generate() call (what an async generator would do, without its per-call hooks).

    The first ``__anext__`` checks and submits the requests (:meth:`SimRolloutEngine._open`); each one then waits
    for the next result. When the consumer leaves early (cancelled while waiting, ``aclose()``, or dropped with
    results still due) the requests left are aborted and dropped, as an async generator's ``finally`` would.
    """

    __slots__ = ("_engine", "_requests", "_inbox", "_mine", "_pending", "_closed")

    def __init__(self, engine: SimRolloutEngine, requests: Sequence[GenerationRequest]) -> None:
        self._engine = engine
        self._requests: Sequence[GenerationRequest] | None = requests
        self._inbox = _Inbox()
        self._mine: list[_Seq] | None = None
        self._pending = 0
        self._closed = False

    def __aiter__(self) -> _Generation:
        return self

    async def __anext__(self) -> GenerationResult:
        if self._closed:
            raise StopAsyncIteration
        if self._mine is None:
            requests, self._requests = self._requests, None
            assert requests is not None
            try:
                mine = self._engine._open(requests, self._inbox)
                if mine is None:
                    mine = await self._engine._open_paused(requests, self._inbox)
            except BaseException:
                self._closed = True
                raise
            self._mine = mine
            self._pending = len(mine)
        if not self._pending:
            self._closed = True
            raise StopAsyncIteration
        inbox = self._inbox
        items = inbox._items
        try:
            while not items:  # _Inbox.get() inlined: one coroutine less per result
                waiter = inbox._waiter = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    inbox._waiter = None
        except BaseException:
            self._leave()
            raise
        item = items.popleft()
        if isinstance(item, BaseException):
            self._leave()
            raise EngineError(f"the sim rollout scheduler failed: {item!r}") from item
        self._pending -= 1
        return item  # type: ignore[return-value]

    def _leave(self) -> None:
        self._closed = True
        if self._pending:
            self._pending = 0
            self._engine._drop(self._mine or [])

    async def aclose(self) -> None:
        self._leave()

    def __del__(self) -> None:
        if not self._closed and self._pending:
            self._leave()


class _Inbox:
    """The results of one generate() call: a deque and a waiter (an ``asyncio.Queue`` without its extras,
    which cost more than the rest of a short call); :meth:`_Generation.__anext__` waits on it."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _join(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``parts`` as one 1-D tensor: the part itself when there is one (no copy), else a ``torch.cat``."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)
