"""The train stage: gathers B fresh prompt groups per step, trains, publishes the new weights.

Folded advantages. For an algorithm that declares ``advantage_scope: group``
(each group's advantages depend on that group's rows only) and a train
sampler that leases whole groups, the train stage computes the advantages in
its own lease (:func:`group_advantages`, the advantage stage's code) and the
run has no advantage stage: that stage's ``get_meta``, ``get``, ``put`` and
``ack`` per lease are gone. Every group the trainer reads has passed every
other stage (log-prob stages included) because the train stage consumes
their columns; failed groups skip it, filtered groups (dynamic sampling)
are marked before the staleness split, as when the stage ran first. See
docs/architecture.md ("Advantages").
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import AsyncflowError, EngineError
from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.outcomes import RowOutcome, merge_outputs
from asyncflow_core.flow.rollout_stage import RolloutStage
from asyncflow_core.flow.stage import LEDGER, Stage
from asyncflow_core.interfaces import Algorithm, TrainEngine, WeightTransport
from asyncflow_core.interfaces.features import algorithm_features
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import Batch, Column, RaggedTensor

__all__ = ["ADVANTAGE", "TrainStage", "group_advantages"]

#: the advantage stage's name: its store task, telemetry lane, processed count and the stage its filters name
ADVANTAGE = "advantage"


def group_advantages(ctx: Any, algorithm: Algorithm, row_ids: torch.Tensor, batch: Batch) -> dict[str, Column]:
    """The ``advantages`` column of ``batch`` (whole prompt groups, store rows ``row_ids``), as the advantage stage
    writes it: a group with a failed row is skipped whole (zeros; the trainer drops it), the others get
    ``algorithm.compute_advantages``; samples it filters out (dynamic sampling) are marked, so the trainer drops
    their groups. Counts the rows computed as the advantage stage's."""
    good = (~ctx.outcomes.group_mask(row_ids, batch[C.GROUP_ID])).nonzero().squeeze(1)
    resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
    out: dict[str, Column] = {C.ADVANTAGES: RaggedTensor(torch.zeros(resp.numel_packed, dtype=torch.float32),
                                                         resp.offsets)}
    if good.numel():
        sub = batch if good.numel() == batch.num_rows else batch.select(good)
        result = algorithm.compute_advantages(sub)
        if C.FILTERED in result.columns:
            ctx.outcomes.filter(ADVANTAGE, row_ids[good][result[C.FILTERED].to(torch.bool).reshape(-1)])
        out = merge_outputs(batch, good, {C.ADVANTAGES: result[C.ADVANTAGES]}, out)
    ctx.processed[ADVANTAGE] += int(good.numel())
    return out


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
        sampler: str = "group", lock: asyncio.Lock | None = None, canary: Any = None, fold_advantages: bool = False,
    ) -> None:
        self.engine = engine
        self.algorithm = algorithm
        self.transport = transport
        self.rollout = rollout
        #: compute group-scoped advantages in each lease (no advantage stage); the pipeline decides (pipeline.py)
        self.fold_advantages = fold_advantages
        cols = [C.PROMPT_IDS, C.RESPONSE_IDS, C.GROUP_ID, C.ADVANTAGES, *consumes]
        self.consumes = tuple(dict.fromkeys(c for c in cols if not (fold_advantages and c == C.ADVANTAGES)))
        self.total_steps = total_steps
        self.bucket_bytes = bucket_bytes
        self.deadline_s = deadline_s
        self.colocated = colocated
        self.sampler = sampler
        self.engine_lock = lock or asyncio.Lock()  #: held for every trainer call (shared with the `old` log-prob stage)
        self.staleness_hist: Counter[int] = Counter()
        self.canary = canary  #: a :class:`~asyncflow_core.flow.canary.Canary` checking the replicas' weights, or None
        self.features = algorithm_features(algorithm)

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
                                                    partial=True, consumer=self.name, lease_s=self.lease())
                    if meta.end_of_stream:
                        ended = True
                        break
                    batch = await ctx.store.get(meta)
                    if self.fold_advantages:  # before the staleness split, as when the advantage stage ran first
                        with ctx.timeline.span(ADVANTAGE, "advantages"):
                            batch = batch.with_columns(**group_advantages(ctx, self.algorithm, meta.row_ids, batch))
                    keep = self._settle(v, meta, batch)
                    if keep.numel():
                        leases.append(meta)
                    else:  # every row settled (dropped or re-queued): done with, or the stream's end never shows
                        await ctx.store.ack(meta)
                    if keep.numel() < batch.num_rows:
                        await ctx.notify(LEDGER)  # re-queued or dropped groups: the feeder may start prompts now
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
            if self.features.advantage_scope == "step":
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
