"""Validation pinned to a weight version: which versions to evaluate, the eval requests, and their metrics.

Async training has no quiet window for validation, so every evaluation here
names the one weight version it measured, and proves it: each token of each
eval completion must carry exactly that version (``GenerationResult.versions``).

The parts, each with one job:

- :class:`EvalScheduler` (a ``VersionPublished`` subscriber): on every
  ``eval.every_steps``-th version (and version 0 / the last one with
  ``at_start`` / ``at_end``) it adds an :class:`EvalRound` for that version to
  the queue;
- :class:`EvalRequests`: the queue the rollout stage draws eval requests from.
  ``take(replica, replica_version, free)`` hands a replica eval requests only
  when its weights are the round's version (the first replica to reach a
  version at or after the requested one pins the round to its version, when
  the requested one was skipped), at most ``eval.priority`` of its slots;
  ``hold(replica, replica_version)`` says the replica must not load newer
  weights yet (its share of a round is not done);
- :class:`Evaluator`: scores a finished round with the run's reward, computes
  pass@1 / pass@k (the unbiased estimator), mean reward, mean length and
  format rate per eval set, refuses (counts and leaves out) completions with a
  token of another version, and writes one record per round to
  ``metrics.jsonl`` (tagged ``eval_version``), TensorBoard / W&B when the run
  logs there, and ``eval.png`` (the curve against the version).

Eval rows never enter the store: their prompts are encoded here and their
completions go straight from the engine to the evaluator, so no training
stage can lease them. :func:`run_pinned` drives a round on engines without a
training run (``asyncflow eval``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.tokenizer import encode_record
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams

log = logging.getLogger("asyncflow.flow")

# the scoring side lives in eval_report.py (re-exported here: one import for callers)
from asyncflow_core.flow.eval_report import Evaluator, eval_png, eval_records, pass_at_k, set_metrics  # noqa: E402,F401

#: request ids of eval requests start with this (the rollout stage tells them from training rows by it)
EVAL_PREFIX = "eval-"


# ------------------------------------------------------------------------------------------------ sets


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt of an eval set, encoded once."""

    label: str  #: the set's label
    index: int  #: position in the set
    prompt_ids: tuple[int, ...]
    record: Any  #: the dataset's PromptRecord (prompt text and metadata for the reward)


@dataclass(frozen=True)
class EvalSet:
    label: str
    prompts: list[EvalPrompt]


def record_key(record: Any) -> str:
    """What makes two prompts the same for the overlap check: the chat, else the prompt text."""
    messages = record.metadata.get("messages") if isinstance(record.metadata, Mapping) else None
    if messages:
        return json.dumps(messages, sort_keys=True)
    return record.prompt if record.prompt else json.dumps(list(record.prompt_token_ids))


def _label(comp: Any, options: Any, i: int) -> str:
    if comp.label:
        return comp.label
    path = getattr(options, "path", None)
    return Path(path).stem if path else f"set{i}"


def load_eval_sets(resolved: Any, tokenizer: Any, train_dataset: Any | None = None) -> list[EvalSet]:
    """The ``eval.datasets`` built by their plugins and encoded (chat rendered) once.

    Logs one warning line per set that shares prompts with ``train_dataset``.
    """
    cfg = resolved.config.eval
    if cfg is None:
        return []
    train_keys = ({record_key(train_dataset[i]) for i in range(len(train_dataset))} if train_dataset is not None
                  else set())
    sets: list[EvalSet] = []
    for i, comp in enumerate(cfg.datasets):
        where = f"eval.datasets[{i}]"
        resolved_comp = resolved.components.get(where)
        if resolved_comp is None:
            raise ConfigError(f"{where}: no dataset plugin {comp.name!r} is installed")
        dataset = resolved_comp.create()
        label = _label(comp, resolved_comp.options, i)
        count = len(dataset) if comp.max_prompts is None else min(len(dataset), comp.max_prompts)
        if count == 0:
            raise ConfigError(f"{where}: the eval set is empty; point its options at a file with prompts")
        prompts = [EvalPrompt(label, j, encode_record(tokenizer, dataset[j]), dataset[j]) for j in range(count)]
        if any(s.label == label for s in sets):
            raise ConfigError(f"{where}: two eval sets are labelled {label!r}; give each a distinct label")
        shared = sum(record_key(p.record) in train_keys for p in prompts)
        if shared:
            log.warning("eval set %r: %d of its %d prompts also appear in the training data; its scores "
                        "overstate held-out accuracy (remove them from one of the files)", label, shared, count)
        sets.append(EvalSet(label, prompts))
    return sets


def eval_sampling(cfg: Any, rollout: Any, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """The sampling parameters of eval requests: the eval section's, the rollout's where it leaves them unset."""
    return SamplingParams(max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=rollout.top_k, stop_token_ids=stop_token_ids)


# ---------------------------------------------------------------------------------------------- rounds


@dataclass(frozen=True)
class EvalItem:
    """One eval completion to make: prompt ``prompt`` of its set, sample ``sample``."""

    request_id: str
    prompt: EvalPrompt
    sample: int


@dataclass
class EvalRound:
    """The completions of every eval prompt at one weight version."""

    requested: int  #: the version asked for
    items: list[EvalItem]
    version: int | None = None  #: the version the round runs at (pinned by the first replica that takes work)
    label_version: int | None = None  #: the version written in the record, when it is not ``version``
    pending: deque[EvalItem] = field(default_factory=deque)
    inflight: dict[int, dict[str, EvalItem]] = field(default_factory=dict)  #: replica -> request id -> item
    results: dict[str, GenerationResult] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  #: request id -> why
    mismatched: dict[str, str] = field(default_factory=dict)  #: request id -> versions its tokens had
    by_id: dict[str, EvalItem] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pending.extend(self.items)
        self.by_id = {it.request_id: it for it in self.items}

    @property
    def finished(self) -> bool:
        return len(self.results) + len(self.failed) + len(self.mismatched) == len(self.items)

    def inflight_on(self, replica: int) -> int:
        return len(self.inflight.get(replica, ()))


def make_round(version: int, sets: Sequence[EvalSet], samples_per_prompt: int) -> EvalRound:
    items = [EvalItem(f"{EVAL_PREFIX}v{version}-{p.label}-{p.index}-{s}", p, s)
             for st in sets for p in st.prompts for s in range(samples_per_prompt)]
    return EvalRound(version, items)


class EvalRequests:
    """Eval requests waiting for a replica whose weights are exactly their round's version.

    ``max_inflight`` is a replica's slot count; ``priority`` the share of them
    eval may take (at least one slot). ``on_complete(round)`` is called (and
    awaited) when every item of a round has a result or failed.
    """

    def __init__(self, sampling: SamplingParams, *, max_inflight: int, priority: float,
                 on_complete: Callable[[EvalRound], Awaitable[None] | None] | None = None) -> None:
        self.sampling = sampling
        self.quota = max(1, int(priority * max_inflight))
        self.rounds: list[EvalRound] = []
        self.on_complete = on_complete
        self._owner: dict[str, EvalRound] = {}

    # -- queue ---------------------------------------------------------------------------------------

    def add(self, rnd: EvalRound) -> EvalRound:
        self.rounds.append(rnd)
        for it in rnd.items:
            self._owner[it.request_id] = rnd
        return rnd

    @staticmethod
    def owns(request_id: str) -> bool:
        """Whether ``request_id`` is an eval request (the rollout stage routes its result here)."""
        return request_id.startswith(EVAL_PREFIX)

    @property
    def outstanding(self) -> bool:
        """Some round is not finished."""
        return bool(self.rounds)

    def inflight_on(self, replica: int) -> int:
        return sum(r.inflight_on(replica) for r in self.rounds)

    def take(self, replica: int, replica_version: int, free: int, *, urgent: bool = False) -> list[GenerationRequest]:
        """Eval requests for ``replica`` (weights at ``replica_version``, ``free`` slots), within its eval quota.

        Only a round pinned at ``replica_version`` gives work, or an unpinned
        round asking for a version at or before it, which this call pins.
        ``urgent``: a newer version waits for this replica (its hold is
        delaying training), so the round may take every free slot and end
        sooner instead of its ``priority`` share.
        """
        room = free if urgent else min(free, self.quota - self.inflight_on(replica))
        out: list[GenerationRequest] = []
        for rnd in self.rounds:
            if room <= 0:
                break
            if not rnd.pending:
                continue
            if rnd.version is None:
                if replica_version < rnd.requested:
                    continue
                if replica_version != rnd.requested:
                    log.info("eval of version %d runs at version %d (the replicas skipped %d)", rnd.requested,
                             replica_version, rnd.requested)
                rnd.version = replica_version
            elif rnd.version != replica_version:
                continue
            mine = rnd.inflight.setdefault(replica, {})
            while rnd.pending and room > 0:
                it = rnd.pending.popleft()
                mine[it.request_id] = it
                out.append(GenerationRequest(request_id=it.request_id, prompt_token_ids=it.prompt.prompt_ids,
                                             sampling=self.sampling))
                room -= 1
        return out

    def hold(self, replica: int, replica_version: int) -> bool:
        """Whether ``replica`` must keep its weights: a round at its version has work in flight on it, or
        pending work it was already serving."""
        for rnd in self.rounds:
            serving = rnd.inflight_on(replica) or (rnd.pending and replica in rnd.inflight)
            if rnd.version == replica_version and serving:
                return True
        return False

    # -- results -------------------------------------------------------------------------------------

    async def result(self, replica: int, res: GenerationResult) -> None:
        """A result of an eval request from ``replica``: kept, re-queued (aborted) or failed."""
        rnd = self._owner.get(res.request_id)
        if rnd is None:
            return
        item = rnd.inflight.get(replica, {}).pop(res.request_id, None)
        if item is None:
            return  # given up already
        if res.finish_reason is FinishReason.ABORT:
            rnd.pending.appendleft(item)  # the same version again (a replica still at it takes it)
            return
        if res.finish_reason is FinishReason.ERROR:
            rnd.failed[item.request_id] = res.error or "engine error"
        else:
            versions = res.versions.tolist() if isinstance(res.versions, torch.Tensor) else list(res.versions)
            other = sorted({int(v) for v in versions} - {rnd.version})
            if other:
                rnd.mismatched[item.request_id] = f"tokens of versions {other}"
            else:
                rnd.results[item.request_id] = res
        await self._maybe_done(rnd)

    async def requeue(self, replica: int) -> None:
        """``replica`` died: its eval requests go back to their rounds' queues."""
        for rnd in self.rounds:
            for it in rnd.inflight.pop(replica, {}).values():
                rnd.pending.appendleft(it)

    async def requeue_all(self) -> None:
        """Every in-flight eval request goes back to its round's queue: the tasks that drove them are gone (the
        rollout stage cancelled them when training ended), so none of them will get a result."""
        for rnd in self.rounds:
            for replica in list(rnd.inflight):
                for it in rnd.inflight.pop(replica).values():
                    rnd.pending.appendleft(it)

    async def expire(self, oldest_served: int) -> None:
        """No live replica holds a version below ``oldest_served``: rounds pinned there fail what is left."""
        for rnd in list(self.rounds):
            if rnd.version is not None and rnd.version < oldest_served and not any(rnd.inflight.values()):
                while rnd.pending:
                    it = rnd.pending.popleft()
                    rnd.failed[it.request_id] = f"no replica serves version {rnd.version} any more"
                await self._maybe_done(rnd)

    async def _maybe_done(self, rnd: EvalRound) -> None:
        if not rnd.finished or rnd not in self.rounds:
            return
        self.rounds.remove(rnd)
        for it in rnd.items:
            self._owner.pop(it.request_id, None)
        if rnd.mismatched:
            log.warning("eval of version %s: %d completions had tokens of another version and were left out",
                        rnd.version, len(rnd.mismatched))
        if self.on_complete is not None:
            done = self.on_complete(rnd)
            if inspect.isawaitable(done):
                await done


# ----------------------------------------------------------------------------------------------- metrics


class EvalScheduler:
    """Adds a round for every due version (a ``VersionPublished`` subscriber)."""

    def __init__(self, config: Any, sets: Sequence[EvalSet], queue: EvalRequests, *, total_steps: int) -> None:
        self.config = config
        self.sets = list(sets)
        self.queue = queue
        self.total_steps = total_steps
        self.asked: list[int] = []

    def due(self, version: int) -> bool:
        cfg = self.config
        if version == 0:
            return cfg.at_start
        if cfg.every_steps and version % cfg.every_steps == 0:
            return True
        return cfg.at_end and version == self.total_steps

    def ask(self, version: int) -> EvalRound | None:
        if not self.due(version) or version in self.asked:
            return None
        self.asked.append(version)
        return self.queue.add(make_round(version, self.sets, self.config.samples_per_prompt))

    def start(self) -> None:
        """Before the first step: the round of version 0 when ``at_start``."""
        self.ask(0)

    async def on_version_published(self, event: VersionPublished) -> None:
        self.ask(event.version)


# --------------------------------------------------------------------------------------- without training


async def run_pinned(engines: Sequence[Any], queue: EvalRequests, *, max_inflight: int) -> None:
    """Drive every round of ``queue`` on ``engines`` (no training beside them) until all are finished."""

    async def drive(i: int, engine: Any) -> None:
        while queue.outstanding:
            reqs = queue.take(i, engine.version, max_inflight - queue.inflight_on(i))
            if not reqs:
                v = engine.version
                if not any(r.pending and (r.version == v or (r.version is None and r.requested <= v))
                           for r in queue.rounds):
                    return  # nothing here for this replica's version
                await asyncio.sleep(0.01)
                continue
            waiting = {q.request_id for q in reqs}
            async for res in engine.generate(reqs):
                waiting.discard(res.request_id)
                await queue.result(i, res)
            for rid in waiting:  # the contract is one result per request: fail what got none
                await queue.result(i, GenerationResult(rid, (), (), (), (), FinishReason.ERROR,
                                                       error="the engine returned no result for it"))

    await asyncio.gather(*(drive(i, e) for i, e in enumerate(engines)))
    if queue.outstanding:
        left = ", ".join(str(r.version if r.version is not None else r.requested) for r in queue.rounds)
        raise ConfigError(f"eval rounds at version(s) {left} found no engine with those weights")


async def finish_rounds(queue: EvalRequests, engines: Sequence[Any], *, max_inflight: int,
                        load_latest: Callable[[], Awaitable[None]] | None = None) -> None:
    """After training ended: load the newest weights (``load_latest``), then run every open round with all slots.

    Requests that were in flight when the rollout stage stopped are queued again first (their driving tasks
    were cancelled with the stage, so they would never get a result and their round would never finish). A
    round pinned to a version no engine holds any more fails what it has left (its record still comes).
    """
    if not queue.outstanding:
        return
    await queue.requeue_all()
    if load_latest is not None:
        await load_latest()
    if engines:
        await queue.expire(min(e.version for e in engines))
    await run_pinned(engines, queue, max_inflight=max_inflight)
