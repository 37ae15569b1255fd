"""The standard RL pipeline's stages: feeder -> rollout -> reward -> (ref / old log-probs) -> advantage -> train.

Each is a :class:`~asyncflow_core.flow.stage.Stage`; see
``docs/architecture.md`` ("The flow runtime") for how they overlap and how
the staleness bound is enforced (:mod:`asyncflow_core.flow.staleness`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.flow import staleness as S
from asyncflow_core.flow.reward_stage import RewardStage
from asyncflow_core.flow.rollout_stage import ROLLOUT_OUT, Replica, RolloutStage
from asyncflow_core.flow.stage import RunStopped, Stage, StageOutput
from asyncflow_core.flow.tokenizer import Tokenizer, encode_record
from asyncflow_core.flow.train_stage import ADVANTAGE, TrainStage, group_advantages
from asyncflow_core.interfaces import Algorithm, Dataset, TrainEngine
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import Batch, RaggedTensor

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
        #: record index -> its prompt ids, encoded once (and as a tensor: a group's n rows and its re-queues reuse it)
        self._token_cache: dict[int, torch.Tensor] = {}

    def _order(self) -> AsyncIterator[int] | Any:
        n = len(self.dataset)
        for epoch in range(self.epochs):
            if self.shuffle:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            else:
                perm = list(range(n))
            for idx in perm:
                yield epoch * n + idx, idx

    def _tokens(self, index: int) -> torch.Tensor:
        ids = self._token_cache.get(index)
        if ids is None:
            rec = self.dataset[index]
            encoded = encode_record(self.tokenizer, rec)  # ConfigError naming the record; chats rendered once here
            if not encoded:
                raise RunStopped(f"dataset record {index} has an empty prompt; remove it or give it text")
            ids = self._token_cache[index] = torch.tensor(encoded, dtype=torch.int64)
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
                position = led.net_started
                info = led.admit(uid, self.dataset[idx])
                info.start_floor = S.start_floor(position, ctx.prompts_per_step, ctx.k, ctx.version)
                groups.append(info)
            if groups:
                await self._put(groups)
            elif exhausted and led.outstanding == 0 and not led.requeue:
                await ctx.store.end_stream()
                return

    def _limit(self) -> int:
        ctx = self.ctx
        limit = S.admission_limit(ctx.version, ctx.k, ctx.prompts_per_step,
                                  ctx.tail.extra_prompts(ctx.prompts_per_step))
        return limit if self.max_prompts is None else min(limit, self.max_prompts)

    async def _put(self, groups: list) -> None:
        n = self.ctx.n
        seqs: list[torch.Tensor] = []
        gids: list[int] = []
        for g in groups:
            ids = self._tokens(g.record.index)  # read only: torch.cat below copies it
            seqs.extend([ids] * n)
            gids.extend([g.group_id] * n)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        prompt = RaggedTensor.from_lengths(torch.cat(seqs), lengths)
        await self.ctx.store.put({C.PROMPT_IDS: prompt, C.GROUP_ID: torch.tensor(gids, dtype=torch.int64)},
                                 group_ids=torch.tensor(gids, dtype=torch.int64))
        self.ctx.counters["prompts_started"] += len(groups)


# rollout: flow/rollout_stage.py; reward: flow/reward_stage.py; train: flow/train_stage.py (re-exported here)


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
    """Group-relative (or any algorithm's) advantages over whole prompt groups (the group sampler).

    Only when the train stage cannot compute them in its own lease (a ``step``-scoped algorithm, a train sampler
    that does not lease whole groups, a stage that reads ``advantages``, or ``pipeline.fold_advantages: false``);
    see :func:`~asyncflow_core.flow.train_stage.group_advantages` and :meth:`PipelinePlan.folds_advantages`.
    """

    name = ADVANTAGE
    produces = (C.ADVANTAGES,)
    sampler = "group"
    span_name = "advantages"

    def __init__(self, algorithm: Algorithm, consumes: Sequence[str], *, n: int, groups_per_lease: int) -> None:
        self.algorithm = algorithm
        self.consumes = tuple(dict.fromkeys([C.RESPONSE_IDS, C.GROUP_ID, *consumes]))
        self.batch_size = n * groups_per_lease

    async def handle(self, meta: BatchMeta, batch: Batch) -> None:
        await self.ctx.store.put(group_advantages(self.ctx, self.algorithm, meta.row_ids, batch), rows=meta)
