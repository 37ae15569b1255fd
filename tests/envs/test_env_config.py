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
        4, 30.0, 64, None, None)
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
