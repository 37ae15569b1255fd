"""The ``sim`` reward declares itself local: a simulated run scores it in the rollout stage's write (the inline
reward, flow/reward_inline.py) instead of a reward stage, and that changes neither the schedule nor what is trained.

The inline path is the general reward stage's code run in the writer (the same inputs, failure isolation and
columns), so a seeded run must train the same rows with the same rewards and advantages, step by step, and keep
its schedule digest (``benchmarks/sim_scaling.py``), with ``reward.inline`` false (the stage) and auto (inline).
"""

from __future__ import annotations

import pytest

from asyncflow_core import columns as C
from asyncflow_core.flow import reward_inline
from asyncflow_core.flow.reward_inline import wants_inline
from asyncflow_plugins.sim.train import SimTrainEngine
from asyncflow_plugins.sim.workload import SimReward, SimRewardConfig
from tests.flow.test_sim_digest import _load  # benchmarks/sim_scaling.py as a module


def test_a_free_sim_reward_is_inlined_and_a_costed_one_keeps_its_stage():
    """Auto inlines the free reward; one that spends modelled scoring time (``score_many``, one sleep a batch)
    stays in the reward stage, where that time overlaps rollout as a reward pool's would."""
    assert wants_inline(None, SimReward(), name="sim", single_turn=True, replaced=False)
    costed = SimReward(SimRewardConfig(seconds_per_sample=0.01))
    assert not wants_inline(None, costed, name="sim", single_turn=True, replaced=False)
    assert not wants_inline(False, SimReward(), name="sim", single_turn=True, replaced=False)


@pytest.mark.parametrize("mode", ["one_step", "async2"])
def test_inline_and_staged_sim_reward_train_the_same_rows_on_the_same_schedule(monkeypatch, mode):
    sim = _load()
    trained: list = []
    scored = [0]
    train_step = SimTrainEngine.train_step
    call = reward_inline.InlineReward.__call__

    async def recording(self, batch, algorithm):
        adv = batch[C.ADVANTAGES]
        rows = sorted(zip(batch[C.GROUP_ID].tolist(), batch[C.REWARD].tolist(),
                          (tuple(a.tolist()) for a in (adv[i] for i in range(batch.num_rows)))))
        trained[-1].append(rows)
        return await train_step(self, batch, algorithm)

    async def counting(self, ctx, rows, items, cols):
        scored[0] += len(items)
        return await call(self, ctx, rows, items, cols)

    monkeypatch.setattr(SimTrainEngine, "train_step", recording)
    monkeypatch.setattr(reward_inline.InlineReward, "__call__", counting)
    runs = {}
    for setting in ("false", "null"):
        trained.append([])
        scored[0] = 0
        row = sim.run_one(16, mode, 2, 16, sets=(f"reward.inline={setting}",))
        runs[setting] = (row, trained[-1], scored[0])
    (staged, staged_steps, staged_scored), (inline, inline_steps, inline_scored) = runs["false"], runs["null"]
    assert staged_scored == 0 and inline_scored >= inline["samples_trained"]  # each path ran as asked
    assert staged["violations"] == inline["violations"] == 0
    assert inline["schedule_digest"] == staged["schedule_digest"]
    assert len(inline_steps) == len(staged_steps) == staged["steps"]
    assert inline_steps == staged_steps  # per step: the same groups, rewards and per-token advantages
    rewards = {r for step in staged_steps for _, r, _ in step}
    assert rewards == {0.0, 1.0}  # both outcomes occur: the comparison is not of constant columns
