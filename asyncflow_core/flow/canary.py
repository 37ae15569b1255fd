"""The weights canary: does a rollout engine sample from the weights the trainer published?

An engine whose ``update_weights`` verifies an update but never applies it
(or applies part of it) still bumps its version, so nothing downstream can
tell: rewards stay flat and the run ends "done". The canary compares the
engine's behaviour log-probs with the trainer's log-probs of the very same
tokens, at the very same version.

Why a probe and not the pipeline's own rows: under one-step staleness every
row a step trains on was sampled one version behind the trainer (the train
loss's ``mismatch_kl`` mixes a step of policy change into the figure), and
rows at the trainer's current version appear only while the trainer is
already changing its weights. So every ``canary.every`` steps, right after
the trainer publishes version v:

1. wait for a live replica to load v (its weight-sync task does so at once);
2. ask it for ``canary.samples`` completions of prompts the step just
   trained on, with the run's sampling parameters and per-request seeds;
3. keep the completions whose every token carries version v, and score them
   with ``TrainEngine.compute_logprobs`` while the trainer still holds v.

The check runs beside the gathering of the next batch; the train stage
waits for it only before its next optimizer step (the trainer must still be
at v), so on a pipeline whose rollout keeps up it costs the trainer one
small forward pass. The canary follows the run's
:class:`~asyncflow_core.flow.events.VersionPublished` event
(:meth:`Canary.published`); the train stage calls :meth:`Canary.before_step`
before each optimizer step. The result lands in the step's metrics
(``canary/mean_abs_dlogp`` ...), a warning above ``canary.warn_above``, and
past ``canary.stop_above`` the run stops with a :class:`RunStopped` naming
the engine and the mismatch.

With a LoRA adapter (``adapter=True``; the runtime passes it when
``trainer.lora`` is set) a skipped adapter sync is what the canary is for
(the engine keeps sampling from an older adapter, or the base model, and
the run trains against it): a check runs every step (``every=1``), and a
check whose replica never loads version v within ``deadline_s`` (the sync
was dropped on the way) is *stale*: flagged like a mismatch (metric
``canary/stale``, counter ``canary_stale``, a warning) and, with
``stop_above`` set, it stops the run. Every check reports
``canary/flagged`` (1 when the step was flagged, 0 when not), so a run's
metrics say step by step whether the policy that sampled was the one
trained.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.stage import FlowContext, RunStopped
from asyncflow_core.types import Batch, FinishReason, GenerationRequest, RaggedTensor, SamplingParams

log = logging.getLogger("asyncflow.flow")


@dataclass(frozen=True)
class CanaryResult:
    """One check: the mismatch between the engine's and the trainer's log-probs of the same tokens."""

    version: int
    replica: int
    tokens: int  #: tokens compared (0: nothing comparable came back)
    mean_abs: float  #: mean |behaviour log-prob - trainer log-prob| per token
    max_abs: float
    stale: bool = False  #: no live replica loaded ``version`` within the deadline (adapter runs: a dropped sync)


class Canary:
    """Every ``every`` versions, probes a rollout replica and compares its log-probs with the trainer's.

    ``replicas`` are the rollout stage's :class:`~asyncflow_core.flow.engine_pool.Replica`
    records (``index``, ``engine``, ``dead``); ``trainer_lock`` is the lock
    every trainer call holds. ``engine_name`` is the configured rollout
    engine, named in warnings and in the stop message.
    """

    def __init__(self, *, every: int, samples: int, warn_above: float, stop_above: float | None,
                 replicas: Sequence[Any], trainer: Any, trainer_lock: asyncio.Lock, sampling: SamplingParams,
                 engine_name: str, deadline_s: float, adapter: bool = False) -> None:
        self.adapter = adapter
        self.every = every
        self.samples = samples
        self.warn_above = warn_above
        self.stop_above = stop_above
        self.replicas = replicas
        self.trainer = trainer
        self.trainer_lock = trainer_lock
        self.sampling = sampling
        self.engine_name = engine_name
        self.deadline_s = deadline_s
        self.results: list[CanaryResult] = []  #: every check, in order
        self._pending: dict[int, asyncio.Task] = {}
        self._report: dict[str, float] = {}
        self.ctx: FlowContext | None = None

    def bind(self, ctx: FlowContext) -> None:
        self.ctx = ctx

    # -- what the run calls ----------------------------------------------------------------

    def published(self, event: VersionPublished) -> None:
        """The trainer published a version after training on the event's batch: start a check when one is due."""
        version = event.version
        if self.every <= 0 or version <= 0 or version % self.every:
            return
        prompts = _distinct_prompts(event.batch, self.samples)
        if prompts:
            self._pending[version] = asyncio.ensure_future(self._check(version, prompts))

    async def before_step(self, version: int) -> None:
        """Wait for the check of ``version`` (the trainer must still hold it); stop the run past ``stop_above``."""
        task = self._pending.pop(version, None)
        if task is None:
            return
        result = await task
        if result is None:
            return
        if result.stale:
            self._report = {"canary/stale": 1.0, "canary/flagged": 1.0, "canary/tokens": 0.0}
            if self.ctx is not None:
                self.ctx.counters["canary_stale"] += 1
            message = self._stale_message(result)
            if self.stop_above is not None:
                raise RunStopped(message)
            log.warning("%s", message)
            return
        flagged = result.mean_abs > self.warn_above
        self._report = {"canary/mean_abs_dlogp": result.mean_abs, "canary/max_abs_dlogp": result.max_abs,
                        "canary/tokens": float(result.tokens), "canary/flagged": float(flagged)}
        if self.adapter:
            self._report["canary/stale"] = 0.0
        if self.stop_above is not None and result.mean_abs > self.stop_above:
            raise RunStopped(self._message(result, f"canary.stop_above = {self.stop_above}"))
        if flagged:
            if self.ctx is not None:
                self.ctx.counters["canary_warnings"] += 1
            log.warning("%s", self._message(result, f"canary.warn_above = {self.warn_above}"))

    def take_metrics(self) -> dict[str, float]:
        """The newest check's figures, once (for the step's metrics record)."""
        report, self._report = self._report, {}
        return report

    async def close(self) -> None:
        """Cancel the checks still running (the run is over) and collect them."""
        tasks = list(self._pending.values())
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the check -------------------------------------------------------------------------

    def _message(self, r: CanaryResult, limit: str) -> str:
        return (f"rollout engine {self.engine_name!r} (replica {r.replica}) does not appear to be running the "
                f"trainer's weights: mean |Δlogp| = {r.mean_abs:.4g} (max {r.max_abs:.4g}) over {r.tokens} tokens "
                f"at version {r.version}, above {limit}; check that its update_weights loads every tensor it "
                "receives")

    def _stale_message(self, r: CanaryResult) -> str:
        return (f"rollout engine {self.engine_name!r}: no replica loaded adapter version {r.version} within "
                f"{self.deadline_s:g} s of its publication (the sync was dropped or never applied), so the run "
                "would train against an older adapter; check the weight transport and the engine's update_weights")

    async def _check(self, version: int, prompts: list[tuple[int, ...]]) -> CanaryResult | None:
        replica = await self._replica_at(version)
        if replica is _STALE:
            result = CanaryResult(version, -1, 0, float("nan"), float("nan"), stale=True)
            self.results.append(result)
            return result
        if replica is None:
            return None
        # per-request seeds: the probe leaves the engine's own sampling generator where it was
        requests = [GenerationRequest(f"canary-v{version}-{i}", p, replace(self.sampling, seed=version * 1009 + i))
                    for i, p in enumerate(prompts)]
        try:
            results = [res async for res in replica.engine.generate(requests)]
        except Exception as exc:  # noqa: BLE001 - a dying replica is the rollout stage's business, not the canary's
            log.debug("canary: replica %d failed the probe (%s: %s)", replica.index, type(exc).__name__, exc)
            return None
        rows = [(res.prompt_token_ids, _ints(res.token_ids), _floats(res.logprobs)) for res in results
                if res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and len(res.token_ids)
                and _all_equal(res.versions, version) and _is_flat(res.token_ids)]
        if not rows:
            return None  # nothing comparable came back (e.g. an engine that returns lengths only)
        batch = Batch({
            C.PROMPT_IDS: RaggedTensor.from_sequences([torch.tensor(p, dtype=torch.int64) for p, _, _ in rows]),
            C.RESPONSE_IDS: RaggedTensor.from_sequences([torch.tensor(t, dtype=torch.int64) for _, t, _ in rows]),
        })
        async with self.trainer_lock:
            if self.trainer.version != version:
                return None  # the trainer moved on (cannot happen while the train stage waits for this check)
            out = await self.trainer.compute_logprobs(batch)
        trainer_lp = out[C.LOGPROBS].values.detach().to(torch.float64).cpu()
        behaviour = torch.tensor([x for _, _, lps in rows for x in lps], dtype=torch.float64)
        delta = (trainer_lp - behaviour).abs()
        result = CanaryResult(version, replica.index, int(delta.numel()), float(delta.mean()), float(delta.max()))
        self.results.append(result)
        log.debug("canary at version %d: mean |dlogp| %.3g over %d tokens", version, result.mean_abs, result.tokens)
        return result

    async def _replica_at(self, version: int) -> Any | None:
        """A live replica that loaded ``version`` (waiting for its weight sync), or None when none will."""
        ctx = self.ctx
        assert ctx is not None

        def ready() -> bool:
            return any(not r.dead and r.engine.version >= version for r in self.replicas) or all(
                r.dead for r in self.replicas)

        try:
            await asyncio.wait_for(ctx.wait_for(ready), self.deadline_s)
        except TimeoutError:
            if self.adapter:
                return _STALE  # an adapter that never arrives is the failure this check exists for
            log.warning("canary: no rollout replica loaded version %d within %.0f s; check skipped", version,
                        self.deadline_s)
            return None
        return next((r for r in self.replicas if not r.dead and r.engine.version == version), None)


_STALE = object()  #: :meth:`Canary._replica_at`'s answer when no replica loaded the version in time


def _distinct_prompts(batch: Batch, limit: int) -> list[tuple[int, ...]]:
    """Up to ``limit`` distinct prompts of ``batch``, in row order."""
    prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
    seen: dict[tuple[int, ...], None] = {}
    for i in range(batch.num_rows):
        seen.setdefault(tuple(prompts[i].tolist()), None)
        if len(seen) >= limit:
            break
    return list(seen)


def _is_flat(values: Any) -> bool:
    return not isinstance(values, torch.Tensor) or values.dim() == 1


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _floats(values: Any) -> list[float]:
    return [float(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _all_equal(values: Any, version: int) -> bool:
    return all(int(v) == version for v in (values.tolist() if isinstance(values, torch.Tensor) else values))
