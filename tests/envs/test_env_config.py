"""The optional `environment` section: absent by default, resolved against the environment plugins."""

from __future__ import annotations

import pytest

from asyncflow_core.config import load_config, resolve
from asyncflow_core.errors import ConfigError

BASE = {"reward": {"name": "exact_match"}, "data": {"name": "calculator"}}


def test_absent_means_single_turn():
    cfg = load_config(data=BASE)
    assert cfg.environment is None
    assert "environment" not in resolve(cfg).components


def test_defaults_and_resolution():
    cfg = load_config(data={**BASE, "environment": {"name": "calculator", "options": {"call_reward": 0.1}}})
    env = cfg.environment
    assert (env.max_turns, env.step_timeout_s, env.workers, env.processes, env.max_episode_tokens) == (
        4, 30.0, None, None, None)  # workers None: replicas x max_inflight (flow/episode_builder.py)
    resolved = resolve(cfg)
    assert resolved.components["environment"].options.call_reward == 0.1
    assert resolved.dump()["environment"]["options"]["max_ops_per_call"] == 1
    over = load_config(data=BASE, overrides=["environment.name=tool_calls", "environment.processes=2"])
    assert over.environment.processes == 2 and "environment" in resolve(over).components


@pytest.mark.parametrize("section, message", [
    ({"name": "nope"}, "environment.name: no environment named 'nope'; available: calculator, guess, tool_calls"),
    ({"name": "calculator", "options": {"max_ops_per_call": 0}}, "environment.options.max_ops_per_call"),
    ({"name": "tool_calls", "options": {"tools": ["no_such_module:f"]}}, "cannot be imported"),
])
def test_bad_sections_are_one_line_errors(section, message):
    with pytest.raises(ConfigError) as info:
        resolve(load_config(data={**BASE, "environment": section}))
    assert message in str(info.value)


def test_generic_fields_are_checked():
    with pytest.raises(ConfigError, match="environment.workers"):
        load_config(data={**BASE, "environment": {"name": "calculator", "workers": 0}})


def test_the_pool_opens_one_environment_per_decode_slot_by_default():
    """Unset environment.workers: replicas x max_inflight, so slow tools never leave decode slots without episodes."""
    from asyncflow_core.config import load_config as load
    from asyncflow_core.flow.episode import build_episodes
    from asyncflow_core.flow.tokenizer import make_tokenizer

    cfg = load("examples/agent_guess.yaml", overrides=["rollout.replicas=2", "rollout.max_inflight=48"])
    episodes = build_episodes(resolve(cfg), make_tokenizer(cfg.model))
    assert episodes.settings.open_env.pool.workers == 96
    cfg = load("examples/agent_guess.yaml", overrides=["environment.workers=5"])
    assert build_episodes(resolve(cfg), make_tokenizer(cfg.model)).settings.open_env.pool.workers == 5
