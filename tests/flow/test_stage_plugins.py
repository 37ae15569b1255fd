"""Stages added or swapped in by plugin name (``pipeline.stages`` / ``pipeline.replace``)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.runtime import run_flow
from asyncflow_core.flow.stage import Stage, StageOutput
from asyncflow_core.plugins import StageBackend, get_plugin_manager, hookimpl

from .test_flow_toy import EXAMPLE


class FirstTokenFilterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: int = Field(0, description="Drop samples whose first response token is this.")


class FirstTokenFilter(Stage):
    name = "first_token_filter"
    consumes = ("response_ids",)
    produces = ("first_token",)

    def __init__(self, config: FirstTokenFilterConfig) -> None:
        self.config = config
        self.seen = 0

    async def process(self, batch):
        resp = batch["response_ids"]
        first = torch.tensor([int(r[0]) if len(r) else -1 for r in resp])
        self.seen += batch.num_rows
        return StageOutput({"first_token": first.float()}, drop=first == self.config.token)


class LengthReward(Stage):
    """A second 'reward model': the reward is the response length."""

    name = "length_reward"
    consumes = ("response_ids",)
    produces = ("reward",)

    def __init__(self, config=None) -> None:
        pass

    async def process(self, batch):
        return StageOutput({"reward": batch["response_ids"].lengths.float()})


class _NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@pytest.fixture
def stage_plugins(fresh_plugins):
    module = types.ModuleType("asyncflow_test_stages")

    @hookimpl
    def asyncflow_stages():
        yield StageBackend(name="first_token_filter", factory=FirstTokenFilter, config_model=FirstTokenFilterConfig,
                           description="test filter")
        yield StageBackend(name="length_reward", factory=LengthReward, config_model=_NoOptions,
                           description="test reward stage")

    module.asyncflow_stages = asyncflow_stages
    sys.modules[module.__name__] = module
    pm = get_plugin_manager()
    pm.register_module(module, distribution="tests", version="0", name=module.__name__)
    yield pm
    sys.modules.pop(module.__name__, None)


def test_a_filter_stage_added_in_config_drops_and_counts_groups(stage_plugins, tmp_path):
    resolved = resolve(load_config(EXAMPLE, ["trainer.total_steps=4", "rollout.max_new_tokens=3",
                                             "pipeline.stages=[{name: first_token_filter, options: {token: 2}}]"]))
    s = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert s["steps"] == 4
    assert s["counters"]["filtered_first_token_filter"] >= 1
    assert s["ledger"]["dropped_filtered"] >= 1
    assert s["ledger"]["trained"] + s["ledger"]["dropped"] + s["ledger"]["unfinished"] == s["ledger"]["admitted"]


def test_the_reward_stage_can_be_swapped_by_name(stage_plugins, tmp_path):
    resolved = resolve(load_config(EXAMPLE, ["trainer.total_steps=2", "rollout.max_new_tokens=3",
                                             "pipeline.replace={reward: {name: length_reward}}"]))
    s = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert s["steps"] == 2
    import json

    rewards = [json.loads(x)["reward_mean"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rewards == [3.0, 3.0]  # every toy response has max_new_tokens tokens


def test_unknown_stage_and_role_are_config_errors(stage_plugins):
    with pytest.raises(ConfigError, match="no stage named 'nope'; available: first_token_filter, length_reward"):
        resolve(load_config(EXAMPLE, ["pipeline.stages=[{name: nope}]"]))
    with pytest.raises(ConfigError, match="'train' cannot be replaced"):
        resolve(load_config(EXAMPLE, ["pipeline.replace={train: {name: length_reward}}"]))
    with pytest.raises(ConfigError, match="pipeline.stages\\[0\\].options"):
        resolve(load_config(EXAMPLE, ["pipeline.stages=[{name: first_token_filter, options: {tokn: 1}}]"]))
