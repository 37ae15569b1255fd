"""The standard RL pipeline's stages: feeder -> rollout -> reward -> (ref / old log-probs) -> advantage -> train.

Each is a :class:`~asyncflow_core.flow.stage.Stage`; see
``docs/architecture.md`` ("The flow runtime") for how they overlap and how
the staleness bound is enforced (:mod:`asyncflow_core.flow.staleness`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import AsyncflowError, EngineError
from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.outcomes import RowOutcome, merge_outputs
from asyncflow_core.flow.rollout_stage import ROLLOUT_OUT, Replica, RolloutStage
from asyncflow_core.flow.stage import RunStopped, Stage, StageOutput
from asyncflow_core.flow.tokenizer import Tokenizer, encode_record
from asyncflow_core.interfaces import (
    Algorithm,
    Dataset,
    Reward,
    TrainEngine,
    WeightTransport,
)
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import (
    Batch,
    RaggedTensor,
    RewardInput,
)

log = logging.getLogger("asyncflow.flow")

__all__ = ["ROLLOUT_OUT", "AdvantageStage", "LogprobStage", "PromptFeeder", "Replica", "RewardStage",
           "RolloutStage", "TrainStage"]


# ------------------------------------------------------------------------------------------- feeder


class PromptFeeder(Stage):
    """Puts ``n`` rows per admitted prompt (a group), under the admission bound; re-queued prompts first."""

    name = "feeder"
    produces = (C.PROMPT_IDS, C.GROUP_ID)

    def __init__(self, dataset: Dataset, tokenizer: Tokenizer, *, epochs: int, shuffle: bool, seed: int,
                 max_prompts: int | None = None) -> None:
        self.dataset = dataset
        #: most prompts (net of dropped ones) the run can ever train (total_steps x B): starting more only wastes
        #: rollout work, and whether they start before the last step ends would depend on timing
        self.max_prompts = max_prompts
        self.tokenizer = tokenizer
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self._token_cache: dict[int, tuple[int, ...]] = {}

    def _order(self) -> AsyncIterator[int] | Any:
        n = len(self.dataset)
        for epoch in range(self.epochs):
            if self.shuffle:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            else:
                perm = list(range(n))
            for idx in perm:
                yield epoch * n + idx, idx

    def _tokens(self, index: int) -> tuple[int, ...]:
        ids = self._token_cache.get(index)
        if ids is None:
            rec = self.dataset[index]
            ids = encode_record(self.tokenizer, rec)  # ConfigError naming the record; chats rendered once here
            if not ids:
                raise RunStopped(f"dataset record {index} has an empty prompt; remove it or give it text")
            self._token_cache[index] = ids
        return ids

    async def run(self) -> None:
        ctx, led = self.ctx, self.ctx.ledger
        order = iter(self._order())
        exhausted = False
        while not ctx.stop.is_set():
            def can_go() -> bool:
                admit = not exhausted and led.net_started < self._limit()
                return bool(led.requeue) or admit or (exhausted and led.outstanding == 0)

            if not can_go():
                with ctx.timeline.span(self.name, "admission_wait"):
                    await ctx.wait_for(can_go)
            if ctx.stop.is_set():
                return
            groups = []
            while led.requeue:
                info = led.requeue.popleft()
                groups.append(led.new_group(info.prompt_uid, info.record, info.attempt))
            while not exhausted and led.net_started < self._limit():
                nxt = next(order, None)
                if nxt is None:
                    exhausted = True
                    break
                uid, idx = nxt
                if uid in led.trained or uid in led.dropped:
                    continue  # settled before a resume
                groups.append(led.admit(uid, self.dataset[idx]))
            if groups:
                await self._put(groups)
            elif exhausted and led.outstanding == 0 and not led.requeue:
                await ctx.store.end_stream()
                return

    def _limit(self) -> int:
        ctx = self.ctx
        limit = S.admission_limit(ctx.version, ctx.k, ctx.prompts_per_step)
        return limit if self.max_prompts is None else min(limit, self.max_prompts)

    async def _put(self, groups: list) -> None:
        n = self.ctx.n
        seqs: list[torch.Tensor] = []
        gids: list[int] = []
        for g in groups:
            ids = torch.tensor(self._tokens(g.record.index), dtype=torch.int64)
            seqs.extend([ids] * n)
            gids.extend([g.group_id] * n)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        prompt = RaggedTensor.from_lengths(torch.cat(seqs), lengths)
        await self.ctx.store.put({C.PROMPT_IDS: prompt, C.GROUP_ID: torch.tensor(gids, dtype=torch.int64)},
                                 group_ids=torch.tensor(gids, dtype=torch.int64))
        self.ctx.counters["prompts_started"] += len(groups)


# rollout: asyncflow_core/flow/rollout_stage.py (re-exported here)


# ------------------------------------------------------------------------------------------- reward


class RewardStage(Stage):
    """Scores each completion with the reward plugin; a sample whose reward raises or times out is failed."""

    name = "reward"
    consumes = (C.PROMPT_IDS, C.RESPONSE_IDS, C.GROUP_ID)
    produces = (C.REWARD,)
    span_name = "score"

    def __init__(self, reward: Reward, tokenizer: Tokenizer, *, workers: int, timeout_s: float) -> None:
        self.reward = reward
        self.tokenizer = tokenizer
        self.concurrency = workers
        self.timeout_s = timeout_s
        self.needs_text = bool(getattr(reward, "needs_text", True))
        self.extra: Counter[str] = Counter()
        self.reward_name: str | None = None  #: the plugin's registered name, for error messages (set by the runtime)

    async def process(self, batch: Batch) -> StageOutput:
        ctx = self.ctx
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
        gids = batch[C.GROUP_ID].tolist()
        rows = batch.row_ids.tolist() if batch.row_ids is not None else list(range(batch.num_rows))
        out = torch.zeros(batch.num_rows, dtype=torch.float32)
        samples = []
        for i in range(batch.num_rows):
            info = ctx.ledger.groups.get(int(gids[i]))
            record = info.record if info is not None else None
            completion_ids = resp[i]
            samples.append(RewardInput(
                prompt=record.prompt if record else "",
                completion=self.tokenizer.decode(completion_ids.tolist()) if self.needs_text else "",
                prompt_token_ids=tuple(prompts[i].tolist()) if self.needs_text else (),
                completion_token_ids=tuple(completion_ids.tolist()) if self.needs_text else (),
                metadata=dict(record.metadata) if record else {},
            ))
        score_many = getattr(self.reward, "score_many", None)
        if callable(score_many):
            # a remote reward pool scores the whole batch in one round trip: (True, value) or (False, why) each
            answers = await score_many(samples, self.timeout_s)
        else:
            answers = [await self._score_one(sample) for sample in samples]
        for i, (ok, value) in enumerate(answers):
            try:
                if not ok:
                    raise _Failed(value)
                if isinstance(value, Mapping):
                    if "reward" not in value:
                        raise ValueError(f"reward {self._label()} returned a mapping without a 'reward' key "
                                         f"(keys: {sorted(map(str, value))}); return {{'reward': <number>, ...}}")
                    extra = {str(key): self._number(v, f"extra value {key!r}") for key, v in value.items()
                             if key != "reward"}
                    self.extra.update(extra)
                    if extra:
                        if len(ctx.reward_extra) >= 1 << 18:  # rows dropped before training never collect theirs
                            for old in sorted(ctx.reward_extra)[: 1 << 17]:
                                del ctx.reward_extra[old]
                        ctx.reward_extra[int(rows[i])] = extra
                    value = value["reward"]
                out[i] = self._number(value, "value")
            except Exception as exc:  # noqa: BLE001 - one sample's failure is recorded, the run goes on
                why = str(exc) if isinstance(exc, _Failed) else f"{type(exc).__name__}: {exc}"
                ctx.fail_rows(self.name, [rows[i]], why)
        return StageOutput({C.REWARD: out})

    async def _score_one(self, sample: RewardInput) -> tuple[bool, Any]:
        """``(True, value)``, or ``(False, why)`` when the reward raised or timed out."""
        try:
            value = self.reward.score(sample)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return True, value
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return False, f"timed out after {self.timeout_s}s"
        except Exception as exc:  # noqa: BLE001 - recorded on the sample by the caller
            return False, f"{type(exc).__name__}: {exc}"

    def _label(self) -> str:
        return repr(self.reward_name) if self.reward_name else type(self.reward).__name__

    def _number(self, value: Any, what: str) -> float:
        """``value`` as a float; anything but a finite real number fails the sample (a NaN would poison training)."""
        if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            number = float(value)
            if math.isfinite(number):
                return number
        raise ValueError(f"reward {self._label()} returned {what} {value!r}, not a finite number; "
                         "a reward must return a float (or a mapping with a float 'reward')")


class _Failed(Exception):
    """A reward that raised or timed out; the message is already the sample's recorded error."""


# ---------------------------------------------------------------------------------------- log-probs


class LogprobStage(Stage):
    """Log-probs of the responses under a train engine: the frozen reference (``ref``) or the proximal policy (``old``)."""

    span_name = "logprobs"
    consumes = (C.PROMPT_IDS, C.RESPONSE_IDS)

    def __init__(self, name: str, column: str | None, engine: TrainEngine, *, batch_size: int,
                 values: bool = False, lock: asyncio.Lock | None = None) -> None:
        self.lock = lock or asyncio.Lock()  #: shared with the train stage when ``engine`` is the trainer
        self.name = name
        self.column = column
        self.values = values
        self.produces = tuple(c for c in (column, C.VALUES if values else None) if c)
        self.engine = engine
        self.batch_size = batch_size

    async def process(self, batch: Batch) -> StageOutput:
        async with self.lock:  # a TrainEngine runs one call at a time
            out = await self.engine.compute_logprobs(batch.project([C.PROMPT_IDS, C.RESPONSE_IDS]),
                                                     values=self.values)
        cols = {self.column: out[C.LOGPROBS]} if self.column else {}
        if self.values:
            cols[C.VALUES] = out[C.VALUES]
        return StageOutput(cols)


# ---------------------------------------------------------------------------------------- advantage


class AdvantageStage(Stage):
    """Group-relative (or any algorithm's) advantages over whole prompt groups (the group sampler)."""

    name = "advantage"
    produces = (C.ADVANTAGES,)
    sampler = "group"
    span_name = "advantages"

    def __init__(self, algorithm: Algorithm, consumes: Sequence[str], *, n: int, groups_per_lease: int) -> None:
        self.algorithm = algorithm
        self.consumes = tuple(dict.fromkeys([C.RESPONSE_IDS, C.GROUP_ID, *consumes]))
        self.batch_size = n * groups_per_lease

    def placeholder(self, batch: Batch) -> dict[str, Any]:
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        return {C.ADVANTAGES: RaggedTensor(torch.zeros(resp.numel_packed, dtype=torch.float32), resp.offsets)}

    async def handle(self, meta: BatchMeta, batch: Batch) -> None:
        # a group with a failed row is skipped whole (the trainer drops it); others get advantages
        ctx = self.ctx
        good = (~ctx.outcomes.group_mask(meta.row_ids, batch[C.GROUP_ID])).nonzero().squeeze(1)
        out = self.placeholder(batch)
        if good.numel():
            sub = batch if good.numel() == batch.num_rows else batch.select(good)
            result = self.algorithm.compute_advantages(sub)
            adv = result[C.ADVANTAGES]
            if C.FILTERED in result.columns:
                # dynamic sampling: the algorithm filters these samples out; the trainer drops their groups
                ctx.outcomes.filter(self.name, meta.row_ids[good][result[C.FILTERED].to(torch.bool).reshape(-1)])
            out = merge_outputs(batch, good, {C.ADVANTAGES: adv}, out)
        ctx.processed[self.name] += int(good.numel())
        await ctx.store.put(out, rows=meta)


# -------------------------------------------------------------------------------------------- train


class TrainStage(Stage):
    """Takes B fresh prompt groups per step, trains, publishes weights; stale and failed groups settle here.

    After each step it stages the new weights and announces :class:`~asyncflow_core.flow.events.VersionPublished`;
    weight sync, the canary, the step's metrics and checkpoints follow that event (flow/events.py).
    """

    name = "train"
    sampler = "group"
    span_name = "train_step"

    def __init__(
        self, engine: TrainEngine, algorithm: Algorithm, transport: WeightTransport, rollout: RolloutStage | None, *,
        consumes: Sequence[str], total_steps: int, bucket_bytes: int, deadline_s: float, colocated: bool,
    ) -> None:
        self.engine = engine
        self.algorithm = algorithm
        self.transport = transport
        self.rollout = rollout
        self.consumes = tuple(dict.fromkeys([C.PROMPT_IDS, C.RESPONSE_IDS, C.GROUP_ID, C.ADVANTAGES, *consumes]))
        self.total_steps = total_steps
        self.bucket_bytes = bucket_bytes
        self.deadline_s = deadline_s
        self.colocated = colocated
        self.engine_lock = asyncio.Lock()  #: held for every trainer call (shared with the `old` log-prob stage)
        self.staleness_hist: Counter[int] = Counter()
        self.canary: Any = None  #: a :class:`~asyncflow_core.flow.canary.Canary` checking the replicas' weights, or None

    async def run(self) -> None:
        ctx = self.ctx
        B, n = ctx.prompts_per_step, ctx.n
        while not ctx.stop.is_set() and self.engine.version < self.total_steps:
            v = self.engine.version
            t_begin = ctx.clock()
            parts: list[Batch] = []
            leases: list[BatchMeta] = []
            lags: list[torch.Tensor] = []
            have = 0
            ended = False
            with ctx.timeline.span(self.name, "wait_batch"):
                while have < B:
                    meta = await ctx.store.get_meta(self.name, self.consumes, (B - have) * n, sampler=self.sampler,
                                                    partial=True, consumer=self.name, lease_s=self.lease_s)
                    if meta.end_of_stream:
                        ended = True
                        break
                    leases.append(meta)
                    batch = await ctx.store.get(meta)
                    keep = self._settle(v, meta, batch)
                    if keep.numel() < batch.num_rows:
                        await ctx.notify()  # re-queued or dropped groups: the feeder may start prompts now
                    if keep.numel():
                        parts.append(batch if keep.numel() == batch.num_rows else batch.select(keep))
                        lags.append(v - meta.min_version[keep])
                        have += int(torch.unique(batch[C.GROUP_ID][keep]).numel())
            if ended and have < B:
                # fewer than B groups will ever come: release them (they stay unfinished in the ledger)
                for m in leases:
                    await ctx.store.release(m)
                ctx.halt(f"the prompt stream ended before step {v} could gather {B} prompt groups")
                break
            train_batch = Batch.cat(parts) if len(parts) > 1 else parts[0]
            # the staleness invariant, checked on the exact rows trained on
            lag = torch.cat(lags)
            if bool((lag > ctx.k).any()):
                raise AssertionError(f"staleness violated: lag {int(lag.max())} > k={ctx.k} at step {v}")
            self.staleness_hist.update(lag.tolist())
            if self.canary is not None:  # its check of version v must finish while the trainer still holds v
                with ctx.timeline.span(self.name, "canary"):
                    await self.canary.before_step(v)
            if self.colocated and self.rollout is not None:
                with ctx.timeline.span(self.name, "sleep"):
                    await self.rollout.sleep_all()
            if getattr(self.algorithm, "advantage_scope", "group") == "step":
                # batch-normalised advantages (and PPO's returns) need the whole step's rows at once
                train_batch = self.algorithm.compute_advantages(train_batch)
            with ctx.timeline.span(self.name, "train_step"):
                async with self.engine_lock:
                    try:
                        metrics = await self.engine.train_step(train_batch, self.algorithm)
                    except AsyncflowError:
                        raise
                    except Exception as exc:  # one line for the CLI, the original kept as the cause
                        raise EngineError(
                            f"train engine {type(self.engine).__name__} failed on step {v} "
                            f"({train_batch.num_rows} samples): {type(exc).__name__}: {exc}. Check that the rollout "
                            "and train engines share a vocabulary and model, and what the engine's error names"
                        ) from exc
            for m in leases:
                await ctx.store.ack(m)
            for g in torch.unique(train_batch[C.GROUP_ID]).tolist():
                ctx.ledger.mark_trained(int(g))
            with ctx.timeline.span(self.name, "send_weights"):
                async with self.engine_lock:
                    report = await self.transport.send(self.engine.export_weights(bucket_bytes=self.bucket_bytes),
                                                       deadline_s=self.deadline_s)
            ctx.version = self.engine.version
            ctx.published = report.version
            if self.colocated and self.rollout is not None:
                with ctx.timeline.span(self.name, "wake"):
                    await self.rollout.wake_all()
            await ctx.events.publish(VersionPublished(self.engine.version, report.version, v, train_batch, metrics,
                                                      report, lag, t_begin))
        if self.engine.version >= self.total_steps:
            ctx.halt("done")

    def _settle(self, v: int, meta: BatchMeta, batch: Batch) -> torch.Tensor:
        """Positions of ``batch`` to train on. Groups with a marked row are dropped (failed > filtered > stale);
        groups outside the staleness bound are re-queued or dropped per the policy."""
        ctx = self.ctx
        gids = batch[C.GROUP_ID]
        reasons = ctx.outcomes.group_reasons(meta.row_ids, gids)
        for g, why in reasons.items():
            ctx.ledger.mark_dropped(int(g), why)
        settled = torch.isin(gids, torch.tensor(list(reasons), dtype=gids.dtype))
        fresh, stale = S.split_fresh_groups(v, ctx.k, gids, meta.min_version)
        fresh = fresh & ~settled
        stale = stale & ~settled
        for g in torch.unique(gids[stale]).tolist():
            if ctx.stale_policy == "drop":
                ctx.ledger.mark_dropped(int(g), RowOutcome.STALE)
            else:
                ctx.ledger.mark_requeued(int(g), RowOutcome.STALE)
        return fresh.nonzero().squeeze(1)
