"""Folded advantages (flow/train_stage.py): the train stage computes group-scoped advantages in its own lease.

The folded path must train on exactly what the advantage stage's path trains on: the same rows with the same
advantages and loss inputs, the same dropped groups when a row fails or the algorithm filters a group out.
Both runs are the toy engines on a real event loop; the trained batches are recorded at the train engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.flow.pipeline import PipelinePlan
from asyncflow_core.flow.runtime import run_flow
from asyncflow_core.flow.stage import Stage
from asyncflow_core.types import RaggedTensor
from asyncflow_plugins.toy.train import ToyTrainEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"


def toy(*overrides: str):
    return resolve(load_config(EXAMPLE, list(overrides)))


def _with_factory(resolved, section: str, factory):
    comp = resolved.components[section]
    record = dataclasses.replace(comp.registered.record, factory=factory)
    resolved.components[section] = dataclasses.replace(comp, registered=dataclasses.replace(comp.registered, record=record))
    return resolved


class _ParityReward:
    """The parity of the completion's token ids: varies within a group, and a group of 4 is all-equal 1 time in 8."""

    needs_text = True

    def score(self, sample):
        return float(sum(sample.completion_token_ids) % 2)


class _FlakyReward(_ParityReward):
    """Raises for one prompt: its samples fail and their groups are dropped."""

    def score(self, sample):
        if sample.prompt == "1+1=":
            raise ValueError("reward server said no")
        return super().score(sample)


def _run(overrides: list[str], fold: bool, reward=None) -> tuple[list[dict], dict]:
    """Every trained batch of a run (as column -> per-row values, rows in group-id order) and its summary."""
    batches: list[dict] = []

    class Recording(ToyTrainEngine):
        async def train_step(self, batch, algorithm):
            order = torch.argsort(batch[C.GROUP_ID] * (1 << 20) + batch.row_ids, stable=True)
            rows = batch.select(order)
            batches.append({c: (rows[c].to_list() if isinstance(rows[c], RaggedTensor) else rows[c].tolist())
                            for c in sorted(rows.columns)})
            return await super().train_step(batch, algorithm)

    resolved = _with_factory(toy(*overrides, f"pipeline.fold_advantages={str(fold).lower()}"), "trainer",
                             Recording)
    if reward is not None:
        resolved = _with_factory(resolved, "reward", lambda cfg: reward)
    summary = run_flow(resolved, write_png=False)
    return batches, summary


def _same_training(overrides: list[str], reward=None) -> tuple[dict, dict]:
    staged, s_staged = _run(overrides, fold=False, reward=reward)
    folded, s_folded = _run(overrides, fold=True, reward=reward)
    assert s_folded["steps"] == s_staged["steps"] > 0
    assert len(folded) == len(staged)
    for a, b in zip(staged, folded):
        assert a.keys() == b.keys() and C.ADVANTAGES in a
        for col in a:
            assert a[col] == b[col], col  # same rows, same values: the advantages are computed on the same groups
    assert s_folded["ledger"] == s_staged["ledger"]
    return s_staged, s_folded


def test_the_folded_path_trains_on_the_same_batches_as_the_advantage_stage():
    _same_training(["async.mode=sync", "trainer.total_steps=5"])


def test_folded_with_a_log_prob_stage_in_between_and_one_step_overlap():
    # decoupled correction: the proximal ('old') log-prob stage runs between the reward and the train stage
    s, f = _same_training(["trainer.total_steps=5", "algorithm.options.correction=decoupled"])
    assert s["staleness_histogram"] == f["staleness_histogram"]


def test_failed_rows_drop_their_whole_group_on_both_paths():
    s, f = _same_training(["async.mode=sync", "trainer.total_steps=4", "pipeline.max_failure_rate=0.5"],
                          reward=_FlakyReward())
    assert s["ledger"]["dropped_failed"] == f["ledger"]["dropped_failed"] >= 1
    assert s["counters"]["failed_reward"] == f["counters"]["failed_reward"] >= 4


def test_dynamic_sampling_drops_the_same_groups_on_both_paths():
    s, f = _same_training(["async.mode=sync", "trainer.total_steps=6", "algorithm.options.dynamic_sampling=true"],
                          reward=_ParityReward())
    assert s["ledger"]["dropped_filtered"] >= 1  # some groups have equal rewards: the test exercises the filter
    assert s["counters"] == f["counters"]


class _Reader(Stage):
    name = "reader"
    consumes = (C.ADVANTAGES,)


def _plan(cfg, scope="group") -> PipelinePlan:
    algo = SimpleNamespace(required_columns=(C.REWARD, C.GROUP_ID), advantage_scope=scope)
    return PipelinePlan(cfg=cfg, algorithm=algo)


def _cfg(fold=True, sampler="group"):
    return SimpleNamespace(pipeline=SimpleNamespace(fold_advantages=fold), sampler=SimpleNamespace(name=sampler))


def test_the_fold_is_decided_by_declarations():
    assert _plan(_cfg()).folds_advantages([])
    assert not _plan(_cfg(), scope="step").folds_advantages([])  # batch-normalised: needs the step's rows
    assert not _plan(_cfg(sampler="fifo")).folds_advantages([])  # leases need not be whole groups
    assert not _plan(_cfg(fold=False)).folds_advantages([])
    assert not _plan(_cfg()).folds_advantages([_Reader()])  # a stage reads the advantages column


@pytest.mark.parametrize("fold", [True, False])
def test_the_advantage_stage_exists_only_when_not_folded(fold, monkeypatch):
    seen: list[list[str]] = []
    orig = PipelinePlan.build

    def build(self, **kw):
        pipe = orig(self, **kw)
        seen.append([st.name for st in pipe.stages])
        return pipe

    monkeypatch.setattr(PipelinePlan, "build", build)
    run_flow(toy("trainer.total_steps=1", f"pipeline.fold_advantages={str(fold).lower()}"), write_png=False)
    assert ("advantage" in seen[0]) is (not fold)
    assert seen[0][-1] == "train"


def test_the_inline_rewards_prompt_ids_are_the_rows_prompts():
    from asyncflow_core.flow.reward_inline import _prompt_ids

    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(0, 50, (int(n),), generator=g).tolist())
               for n in torch.randint(0, 6, (40,), generator=g)]
    got = _prompt_ids(prompts)
    want = RaggedTensor.from_sequences([torch.tensor(p, dtype=torch.int64) for p in prompts])
    assert got.values.dtype == torch.int64 and got.to_list() == want.to_list() == [list(p) for p in prompts]
