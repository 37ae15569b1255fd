"""An inline reward: a local, cheap reward scored in the rollout stage's write, with no reward stage of its own.

The reward stage (flow/reward_stage.py) costs four store calls per lease
(``get_meta``, ``get``, ``put``, ``ack``) and a task switch per batch,
whatever the reward costs. For a rule-based reward that answers in
microseconds in the driver's process (``arithmetic``, ``exact_match``), that
bookkeeping is most of the work: about a third of the driver's store calls a
step on the arithmetic example. Inline, the rollout stage's trajectory
writer scores each write's rows with the same code
(:meth:`RewardStage.outputs`: the same inputs, extra-value columns, failure
isolation and error messages) and puts the reward columns in the same
``put`` as the tokens, so a row is ready for advantages the moment it is
written.

What stays with the reward stage: a reward that is remote (a reward pool,
``score_many``), asynchronous (``async def score``: it would block the
writer, and ``reward.timeout_s`` and ``reward.workers`` are the reward
stage's), a replacement stage (``pipeline.replace.reward``), multi-turn and
captured episodes, and any reward that does not declare itself local.
``reward.inline`` (config) picks: null (auto) inlines exactly the rewards
that declare ``local = True`` and qualify; true forces it for any qualifying
reward; false keeps the stage. See docs/architecture.md ("Inline reward").
"""

from __future__ import annotations

import inspect
from itertools import chain
from typing import Any

import numpy as np
import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.reward_stage import RewardStage
from asyncflow_core.interfaces.features import reward_features
from asyncflow_core.types import Batch, Column, RaggedTensor

__all__ = ["InlineReward", "inline_reason", "wants_inline"]


def inline_reason(reward: Any) -> str | None:
    """Why ``reward`` cannot be scored inline (None: it can): remote, batch or asynchronous scoring."""
    if reward is None:
        return "there is no reward plugin"
    if reward_features(reward).supports_score_many:
        return "it scores batches remotely (score_many), which the reward stage's leases overlap with rollout"
    score = getattr(reward, "score", None)
    if inspect.iscoroutinefunction(score) or inspect.iscoroutinefunction(getattr(score, "__call__", None)):
        return "its score() is asynchronous, and reward.timeout_s and reward.workers apply in the reward stage"
    return None


def wants_inline(setting: bool | None, reward: Any, *, name: str, single_turn: bool, replaced: bool) -> bool:
    """Whether the run scores its reward inline: ``setting`` is ``reward.inline`` (None: auto).

    Auto inlines a qualifying reward whose class declares ``local = True`` (synchronous, cheap, no I/O). Forcing
    it on a reward that cannot be inlined is a :class:`ConfigError` saying why and how to fix it.
    """
    if setting is False:
        return False
    why = inline_reason(reward)
    if why is None and replaced:
        why = "pipeline.replace.reward replaces the reward stage"
    if why is None and not single_turn:
        why = "multi-turn and captured episodes are scored by the reward stage (or their environment)"
    if setting is None:
        return why is None and reward_features(reward).local
    if why is not None:
        raise ConfigError(f"reward.inline: true, but reward {name!r} cannot be scored inline: {why}; set "
                          "reward.inline to null (auto) or false")
    return True


class InlineReward:
    """Scores the rows of one trajectory-writer flush with a :class:`RewardStage`'s code; the writer's ``score``.

    The stage is never a store task: it is bound to the run's context on first use, records its ``score``
    spans on the ``reward`` lane, counts its rows as the reward stage's, and fails rows under its name.
    """

    def __init__(self, stage: RewardStage) -> None:
        self.stage = stage
        self.produces = stage.produces

    async def __call__(self, ctx: Any, rows: torch.Tensor, items: list, cols: dict[str, Column]) -> dict[str, Column]:
        """The reward columns for a write of single-turn ``items`` (``(request, result or None)``) with ``cols``."""
        stage = self.stage
        if getattr(stage, "ctx", None) is not ctx:
            stage.bind(ctx)
        columns: dict[str, Column] = {C.RESPONSE_IDS: cols[C.RESPONSE_IDS],
                                      C.GROUP_ID: torch.tensor([q.group for q, _ in items], dtype=torch.int64)}
        if stage.needs_text:  # the stage reads prompt ids only for a reward that reads text (RewardStage._texts):
            # a simulated step's prompts are millions of ids that a lengths-only reward never looks at
            columns[C.PROMPT_IDS] = _prompt_ids([q.prompt for q, _ in items])
        batch = Batch(columns, row_ids=rows)
        with ctx.timeline.span("reward", stage.span_name):
            out, _ = await stage.outputs(rows, batch)
        return out


def _prompt_ids(prompts: list[tuple[int, ...]]) -> RaggedTensor:
    """The rows' prompt ids (the tuples their requests carry) as one ragged tensor, built by numpy from the tuples:
    half the CPU of a Python list of every token made into a tensor. (Gathering the rows from their leases'
    ``prompt_ids`` tensors instead costs more whenever a write's rows are not one run of one lease.)"""
    lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    flat = np.fromiter(chain.from_iterable(prompts), dtype=np.int64, count=int(lengths.sum()))
    return RaggedTensor.from_lengths(torch.from_numpy(flat), torch.from_numpy(lengths))
