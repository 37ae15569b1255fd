"""The run's stages, built finished from config, and the column graph they form, checked before anything runs.

Every stage declares the columns it ``consumes`` and ``produces``
(:class:`~asyncflow_core.flow.stage.Stage`); the store hands a stage a row
once the row holds every column it consumes. :func:`check_columns` checks
that graph generically, whatever stages it holds and in whatever order:
every consumed column has exactly one producer, and where two stages
declare a column's kind (dense or ragged) and dtype, they agree. A missing
producer is one :class:`ConfigError` naming the stage and the column.

:class:`PipelinePlan` decides which built-in stages a run needs from the
algorithm's columns and the plugin stages (a plugin stage that produces
``ref_logprobs`` replaces the reference model, so no reference engine is
built); :meth:`PipelinePlan.build` constructs them with every field set by
their constructors. Other code adds stages with ``extra_stages=`` and passes
rollout options with ``rollout_options=`` (see :meth:`PipelinePlan.build`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.reward_inline import InlineReward, wants_inline
from asyncflow_core.flow.rollout_stage import ROLLOUT_OUT, RolloutStage
from asyncflow_core.flow.stage import PER_RESPONSE_TOKEN, STANDARD_COLUMN_TYPES, Stage
from asyncflow_core.flow.staleness import TailPolicy
from asyncflow_core.flow.stages import AdvantageStage, LogprobStage, PromptFeeder, RewardStage, TrainStage
from asyncflow_core.interfaces import KVCachePolicy
from asyncflow_core.interfaces.features import algorithm_features

__all__ = ["ColumnType", "Pipeline", "PipelinePlan", "check_columns", "column_type"]


@dataclass(frozen=True)
class ColumnType:
    """A column's kind (``dense``: one value per row; ``ragged``: a sequence per row), dtype, and whether it holds
    one value per response token."""

    kind: str
    dtype: torch.dtype
    per_token: bool = False

    def __str__(self) -> str:
        tail = ", per response token" if self.per_token else ""
        return f"{self.kind} {str(self.dtype).removeprefix('torch.')}{tail}"


def column_type(stage: Stage, column: str) -> ColumnType | None:
    """The type ``stage`` declares for ``column`` (its ``column_types``), else the standard one, else None."""
    declared = stage.column_types.get(column) or STANDARD_COLUMN_TYPES.get(column)
    if declared is None:
        return None
    kind, dtype = declared
    return ColumnType(kind, dtype, kind == "ragged" and column in PER_RESPONSE_TOKEN)


def check_columns(stages: Sequence[Stage], *, readers: Mapping[str, str] | None = None) -> None:
    """Refuse a stage graph with a consumed column no stage produces, a column two stages produce, or two stages
    that disagree on a column's type. ``readers``: stage name -> who else reads its inputs (for the message)."""
    producer: dict[str, Stage] = {}
    for st in stages:
        for col in st.produces:
            other = producer.get(col)
            if other is not None and other is not st:
                raise ConfigError(f"column {col!r} is produced by two stages, {other.name!r} and {st.name!r}; "
                                  "remove one of them (a stage plugin that produces a built-in column replaces "
                                  "the built-in stage only for ref_logprobs, old_logprobs and values)")
            producer[col] = st
    for st in stages:
        for col in st.consumes:
            src = producer.get(col)
            if src is None:
                who = f" (for {readers[st.name]})" if readers and st.name in readers else ""
                raise ConfigError(f"stage {st.name!r} consumes column {col!r}{who}, which no stage produces; add a "
                                  f"stage that produces {col!r} (pipeline.stages) or pick a setup that does not "
                                  "need it")
            want, have = st.column_types.get(col), column_type(src, col)
            if want is not None and have is not None:
                want_t = ColumnType(want[0], want[1], want[0] == "ragged" and col in PER_RESPONSE_TOKEN)
                if (want_t.kind, want_t.dtype) != (have.kind, have.dtype):
                    raise ConfigError(f"stage {st.name!r} reads column {col!r} as {want_t}, but stage {src.name!r} "
                                      f"writes it as {have}; make the two declarations (column_types) agree")


#: episode columns the train stage reads when the rollout writes them: the loss mask (the loss) and the dense
#: per-episode figures (each step's metrics record)
_EPISODE_TO_TRAINER = (C.LOSS_MASK, C.EPISODE_TURNS, C.EPISODE_TOOL_CALLS, C.EPISODE_TOOL_OK, C.EPISODE_ENV_S,
                       C.EPISODE_MASKED_FRAC, C.EPISODE_TOOL_S, C.EPISODE_CORRECT)


@dataclass
class Pipeline:
    """A run's stages in order, with the two the runtime drives directly."""

    stages: list[Stage]
    rollout: RolloutStage
    train: TrainStage
    trainer_lock: asyncio.Lock  #: held for every trainer call (train step, proximal log-probs, canary, checkpoint)
    reward_stage: Stage | None = None  #: the stage that scores rows (None: the environment owns the reward)


@dataclass
class PipelinePlan:
    """Which built-in stages a run needs, known before any engine is built.

    ``plugins``: the configured stage plugins (``pipeline.stages``), and
    ``reward_stage`` the replacement of the reward stage
    (``pipeline.replace.reward``) or None. A built-in log-prob stage is
    planned for each of ``ref_logprobs``, ``old_logprobs`` and ``values``
    the algorithm reads and no plugin produces.
    """

    cfg: Any
    algorithm: Any
    plugins: list[Stage] = field(default_factory=list)
    reward_stage: Stage | None = None

    def __post_init__(self) -> None:
        if self.reward_stage is not None and C.REWARD not in self.reward_stage.produces:
            raise ConfigError(f"pipeline.replace.reward: stage {self.reward_stage.name!r} must produce the 'reward' "
                              "column")
        from_plugins = {c for st in self._added() for c in st.produces}
        required = tuple(self.algorithm.required_columns)
        self.needs_ref = C.REF_LOGPROBS in required and C.REF_LOGPROBS not in from_plugins
        self.needs_old = C.OLD_LOGPROBS in required and C.OLD_LOGPROBS not in from_plugins
        self.needs_values = C.VALUES in required and C.VALUES not in from_plugins

    def folds_advantages(self, stages: Sequence[Stage]) -> bool:
        """Whether the train stage computes the advantages in its own lease, with no advantage stage.

        By declarations only: ``pipeline.fold_advantages`` is on, the algorithm's advantages are group-scoped
        (:class:`~asyncflow_core.interfaces.features.AlgorithmFeatures` ``advantage_scope: group``: a group's
        advantages read that group's rows only, so any lease of whole groups gives the same values), the train
        sampler hands out whole groups only (it defines ``whole_group_size``, as the ``group`` sampler does), and
        none of ``stages`` reads ``advantages``. Otherwise the advantage stage runs.
        """
        cfg = self.cfg
        if not getattr(cfg.pipeline, "fold_advantages", True):
            return False
        if algorithm_features(self.algorithm).advantage_scope != "group":
            return False
        if any(C.ADVANTAGES in st.consumes for st in stages):
            return False
        from asyncflow_core.plugins import get_plugin_manager  # late: the plan is built before any plugin is made

        found = get_plugin_manager().registrations("sampler").get(cfg.sampler.name)
        return found is not None and callable(getattr(found.record.factory, "whole_group_size", None))

    def _added(self) -> list[Stage]:
        return [*([self.reward_stage] if self.reward_stage is not None else []), *self.plugins]

    def build(self, *, dataset: Any, tokenizer: Any, replicas: list[Any], transport: Any, sampling: Any,
              reward: Any, trainer: Any, ref_engine: Any = None,
              canary: Callable[[RolloutStage, asyncio.Lock], Any] | None = None,
              rollout_options: Mapping[str, Any] | None = None,
              extra_stages: Sequence[Stage] = ()) -> Pipeline:
        """The stages in order: feeder, rollout, reward, plugin and ``extra_stages``, ref, old, advantage, train.

        ``rollout_options``: more keyword arguments for :class:`RolloutStage`
        (e.g. ``episodes=``). ``extra_stages``: stages added after the plugin
        stages; like them, every sample passes them before advantages are
        computed, and the trainer receives the columns they produce.
        ``canary(rollout, trainer_lock)`` returns the weights canary or None.
        """
        cfg, algorithm = self.cfg, self.algorithm
        B, n = cfg.data.prompts_per_step, cfg.rollout.n
        rollout = RolloutStage(
            replicas, transport, sampling, max_inflight=cfg.rollout.max_inflight,
            rows_per_lease=cfg.rollout.rows_per_lease, lease_s=cfg.pipeline.lease_s,
            write_interval_s=cfg.pipeline.write_interval_s, deadline_s=cfg.weight_transport.deadline_s,
            kv_cache=KVCachePolicy(cfg.rollout.kv_cache), **dict(rollout_options or {}),
        )
        reward_stage: Stage | None
        if C.REWARD in rollout.produces:  # episodes of an environment that owns the reward: it is written with them
            if self.reward_stage is not None:
                raise ConfigError("pipeline.replace.reward: the episodes write the reward (an environment that owns "
                                  "it, or a captured agent's), so no reward stage runs; remove pipeline.replace.reward "
                                  "or use an environment that leaves the reward to a reward plugin")
            if cfg.reward.inline:
                raise ConfigError("reward.inline: true, but the episodes write the reward (an environment that owns "
                                  "it, or a captured agent's), so nothing is scored inline; set reward.inline to null "
                                  "(auto) or false")
            reward_stage = None
        else:
            reward_stage = self.reward_stage or RewardStage(
                reward, tokenizer, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s,
                batch_size=cfg.pipeline.reward_batch or B * n, reward_name=cfg.reward.name)
        inline = reward_stage is not None and wants_inline(
            cfg.reward.inline, reward, name=cfg.reward.name, single_turn=rollout.produces == ROLLOUT_OUT,
            replaced=self.reward_stage is not None)
        if inline:  # scored in the rollout stage's write: the reward columns are the rollout's (flow/reward_inline.py)
            rollout.writer.score = InlineReward(reward_stage)  # type: ignore[arg-type]
            rollout.produces = (*rollout.produces, *reward_stage.produces)  # type: ignore[union-attr]
        added = [*self.plugins, *extra_stages]
        stages: list[Stage] = [
            # over-provisioned prompts are admitted to the end too (those left at the stop count as unfinished)
            PromptFeeder(dataset, tokenizer, epochs=cfg.data.epochs, shuffle=cfg.data.shuffle, seed=cfg.seed,
                         max_prompts=cfg.trainer.total_steps * B + TailPolicy.from_config(cfg.async_).extra_prompts(B)),
            rollout, *([reward_stage] if reward_stage is not None and not inline else []), *added,
        ]
        names = [st.name for st in stages]
        if len(set(names)) != len(names):
            raise ConfigError(f"stage names must be unique (they are store task names); got {names}")
        lock = asyncio.Lock()
        if self.needs_ref:
            if ref_engine is None:
                raise ConfigError(f"algorithm {cfg.algorithm.name!r} reads {C.REF_LOGPROBS!r}: a reference engine "
                                  "is needed (or a stage plugin that produces the column)")
            stages.append(LogprobStage("ref", C.REF_LOGPROBS, ref_engine, batch_size=cfg.pipeline.logprob_batch))
        if self.needs_old or self.needs_values:
            # one forward pass gives the proximal log-probs and the value estimates before the step
            stages.append(LogprobStage("old", C.OLD_LOGPROBS if self.needs_old else None, trainer,
                                       batch_size=cfg.pipeline.logprob_batch, values=self.needs_values, lock=lock))
        inputs = [c for c in algorithm.required_columns if c != C.ADVANTAGES]
        inputs += [c for st in added for c in st.produces]  # every added stage sees a sample first
        if C.LOSS_MASK in rollout.produces and not algorithm_features(algorithm).honours_loss_mask:
            raise ConfigError(f"algorithm {cfg.algorithm.name!r} does not declare that its loss skips masked tokens "
                              "(AlgorithmFeatures.honours_loss_mask), so these episodes would train on observation "
                              "and tool tokens; use grpo, rloo, reinforce_pp or ppo, or declare it once the loss "
                              "honours loss_mask (the spec's AlgorithmSpec checks it)")
        # the reward's declared extra values (correct, answer_found): each step's record averages them
        if reward_stage is not None:
            inputs += [c for c in reward_stage.produces if c.startswith(C.REWARD_EXTRA_PREFIX) and c not in inputs]
        # episodes: the trainer gets the loss mask, and each step's record the per-episode figures (dense, small)
        inputs += [c for c in rollout.produces if c in _EPISODE_TO_TRAINER and c not in inputs]
        fold = self.folds_advantages(stages)
        if not fold:
            # a lease takes every whole group that is ready, up to one step's worth (partial: it never waits for
            # more): one store round trip per batch of groups, which an actor-backed store (ray) pays per call
            stages.append(AdvantageStage(algorithm, inputs, n=n, groups_per_lease=B))
        train = TrainStage(
            trainer, algorithm, transport, rollout, consumes=inputs, total_steps=cfg.trainer.total_steps,
            bucket_bytes=int(cfg.weight_transport.bucket_mb * (1 << 20)), deadline_s=cfg.weight_transport.deadline_s,
            colocated=bool(cfg.async_.colocated), sampler=cfg.sampler.name, lock=lock,
            canary=canary(rollout, lock) if canary is not None else None, fold_advantages=fold,
        )
        stages.append(train)
        readers = {"train": f"algorithm {cfg.algorithm.name!r}", "advantage": f"algorithm {cfg.algorithm.name!r}"}
        check_columns(stages, readers=readers)
        return Pipeline(stages, rollout, train, lock, reward_stage)
