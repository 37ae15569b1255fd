"""The column graph check (flow/pipeline.py): generic over stages, plugin stages anywhere, one clear error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.pipeline import PipelinePlan, check_columns, column_type
from asyncflow_core.flow.stage import Stage


def stage(name: str, consumes=(), produces=(), types=None) -> Stage:
    cls = type(name.title(), (Stage,), {"name": name, "consumes": tuple(consumes), "produces": tuple(produces),
                                         "column_types": types or {}})
    return cls()


BASE = [stage("feeder", produces=[C.PROMPT_IDS, C.GROUP_ID]),
        stage("rollout", [C.PROMPT_IDS], [C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS]),
        stage("reward", [C.RESPONSE_IDS], [C.REWARD])]


def test_a_consumed_column_nobody_produces_is_one_error_naming_stage_and_column():
    with pytest.raises(ConfigError, match=r"stage 'train' consumes column 'ref_logprobs' \(for algorithm 'x'\), "
                                          "which no stage produces"):
        check_columns([*BASE, stage("train", [C.REWARD, C.REF_LOGPROBS])], readers={"train": "algorithm 'x'"})


def test_a_plugin_stage_may_produce_or_consume_ref_logprobs_anywhere_in_the_list():
    ref = stage("my_ref", [C.PROMPT_IDS, C.RESPONSE_IDS], [C.REF_LOGPROBS])
    kl = stage("kl_filter", [C.REF_LOGPROBS, C.BEHAVIOR_LOGPROBS], ["kl"])
    check_columns([kl, *BASE, stage("train", [C.REF_LOGPROBS, "kl"]), ref])  # order does not matter


def test_two_producers_and_disagreeing_types_are_refused():
    with pytest.raises(ConfigError, match="'reward' is produced by two stages, 'reward' and 'judge'"):
        check_columns([*BASE, stage("judge", [C.RESPONSE_IDS], [C.REWARD])])
    bad = stage("reader", [C.REWARD], types={C.REWARD: ("ragged", torch.float32)})
    with pytest.raises(ConfigError, match="reads column 'reward' as ragged float32, but stage 'reward' writes it "
                                          "as dense float32"):
        check_columns([*BASE, bad])
    calls = stage("tools", [C.RESPONSE_IDS], ["n_calls"], types={"n_calls": ("dense", torch.int64)})
    ok = stage("reader", ["n_calls"], types={"n_calls": ("dense", torch.int64)})
    check_columns([*BASE, calls, ok])
    assert str(column_type(BASE[1], C.BEHAVIOR_LOGPROBS)) == "ragged float32, per response token"


def _plan(required, plugins=(), reward_stage=None) -> PipelinePlan:
    algo = SimpleNamespace(required_columns=tuple(required))
    return PipelinePlan(cfg=None, algorithm=algo, plugins=list(plugins), reward_stage=reward_stage)


def test_a_plugin_that_produces_ref_logprobs_replaces_the_reference_model():
    need = [C.REWARD, C.BEHAVIOR_LOGPROBS, C.REF_LOGPROBS, C.OLD_LOGPROBS]
    assert _plan(need).needs_ref and _plan(need).needs_old
    plugin = stage("my_ref", [C.PROMPT_IDS, C.RESPONSE_IDS], [C.REF_LOGPROBS])
    plan = _plan(need, [plugin])
    assert not plan.needs_ref and plan.needs_old and not plan.needs_values


def test_a_reward_replacement_must_produce_reward():
    with pytest.raises(ConfigError, match="pipeline.replace.reward: stage 'judge' must produce the 'reward' column"):
        _plan([C.REWARD], reward_stage=stage("judge", [C.RESPONSE_IDS], ["score"]))


def test_episodes_with_a_loss_mask_need_an_algorithm_that_honours_it():
    """Multi-turn rows carry loss_mask 0 on tool output: an algorithm that does not declare it skips masked tokens
    is refused before anything runs (it would train on tool output)."""
    from asyncflow_core.config import load_config
    from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT

    cfg = load_config("examples/agent_guess.yaml")
    episodes = SimpleNamespace(columns=(*ROLLOUT_OUT, C.LOSS_MASK, C.REWARD), multi_turn=True)
    old_algo = SimpleNamespace(required_columns=(C.ADVANTAGES, C.BEHAVIOR_LOGPROBS))
    plan = PipelinePlan(cfg=cfg, algorithm=old_algo, plugins=[])
    with pytest.raises(ConfigError, match="does not declare that its loss skips masked tokens"):
        plan.build(dataset=[], tokenizer=None, replicas=[], transport=None, sampling=None, reward=None,
                   trainer=None, rollout_options={"episodes": episodes})
    from asyncflow_core.interfaces.features import algorithm_features
    from asyncflow_core.plugins import get_plugin_manager

    for name in ("grpo", "rloo", "reinforce_pp", "ppo"):  # the built-ins all honour it (AlgorithmSpec proves it)
        assert algorithm_features(get_plugin_manager().create("algorithm", name, {})).honours_loss_mask, name


@pytest.mark.parametrize("overrides, rows", [([], 32 * 8), (["pipeline.reward_batch=24"], 24)])
def test_the_reward_stage_leases_a_steps_rows_unless_reward_batch_says_otherwise(overrides, rows):
    """Default ``pipeline.reward_batch``: a lease takes every ready row up to one step's (prompts_per_step x n), so a
    cheap reward costs a few store calls a step instead of one lease per 32 rows; an explicit value is kept."""
    from asyncflow_core.config import load_config
    from asyncflow_core.plugins import get_plugin_manager

    cfg = load_config("examples/arithmetic_grpo.yaml", overrides)
    algo = get_plugin_manager().create("algorithm", "grpo", {"group_size": 8})
    pipe = PipelinePlan(cfg=cfg, algorithm=algo, plugins=[]).build(
        dataset=[], tokenizer=None, replicas=[], transport=None, sampling=None, reward=None, trainer=None)
    assert pipe.reward_stage is not None and pipe.reward_stage.batch_size == rows
    assert pipe.rollout.rows_per_lease == cfg.rollout.rows_per_lease == 256
