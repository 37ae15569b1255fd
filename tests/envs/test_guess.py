"""The guess task: dataset, feedback, rewards, malformed turns, the hermes variant, and its EnvironmentSpec run."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import Action
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import RewardInput
from asyncflow_plugins.envs.guess import solve
from asyncflow_plugins.envs.tools import render_hermes_call
from asyncflow_spec import EnvironmentSpec


def act(turn: int, text: str, finish: str = "stop") -> Action:
    return Action(token_ids=(), text=text, finish_reason=finish, turn=turn)


def play(options: dict, record, turns: list[str]):
    env = get_plugin_manager().create("environment", "guess", options)

    async def main():
        obs = await env.reset(record, seed=0)
        steps = []
        for t, text in enumerate(turns):
            steps.append(await env.step(act(t, text)))
            if steps[-1].done:
                break
        await env.close()
        return obs, steps

    return asyncio.run(main())


def row(secret: int, **extra) -> dict:
    return {"index": 0, "prompt": "=", "prompt_token_ids": (), "answer": str(secret), "terminator": ".", **extra}


def test_dataset_is_seeded_uniform_and_hides_the_secret():
    pm = get_plugin_manager()
    ds = pm.create("dataset", "guess", {"size": 2000})
    again = pm.create("dataset", "guess", {"size": 2000})
    other = pm.create("dataset", "guess", {"size": 2000, "seed": 1})
    recs = [ds[i] for i in range(2000)]
    assert recs == [again[i] for i in range(2000)] != [other[i] for i in range(2000)]
    assert ds.stop_text == "."
    assert {r.prompt for r in recs} == {"="}  # the prompt tells nothing about the secret
    counts = [sum(r.metadata["answer"] == str(v) for r in recs) for v in range(10)]
    # each value ~200 of 2000; 5 binomial standard deviations (sqrt(2000*.1*.9) ~ 13.4) either side
    assert all(abs(c - 200) < 5 * math.sqrt(2000 * 0.1 * 0.9) for c in counts), counts
    wide = pm.create("dataset", "guess", {"low": 10, "high": 99, "template": "{low}-{high}="})[3]
    assert wide.prompt == "10-99=" and 10 <= int(wide.metadata["answer"]) <= 99
    with pytest.raises(ConfigError, match="template"):
        pm.validate_options("dataset", "guess", {"template": "{answer}="})
    with pytest.raises(ConfigError, match="larger than high"):
        pm.validate_options("dataset", "guess", {"low": 5, "high": 4})
    with pytest.raises(IndexError):
        ds[2000]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60), st.data())
def test_binary_search_is_answered_and_rewarded(a, b, data):
    low, high = min(a, b), max(a, b)
    secret = data.draw(st.integers(low, high))
    turns = solve(secret, low, high)
    assert len(turns) <= math.ceil(math.log2(high - low + 2))
    obs, steps = play({}, row(secret), turns)
    assert obs.text == "="
    assert len(steps) == len(turns) and steps[-1].done and steps[-1].reward == 1.0
    for text, step in zip(turns[:-1], steps[:-1]):
        expected = "<" if secret < int(text[:-1]) else ">"
        assert step.observation.text == expected and step.reward == 0.0 and not step.done
    assert all(s.info["tool_calls"] == 1 and s.info["tool_ok"] for s in steps)


def test_discount_and_max_turns_cut():
    _, steps = play({"discount": 0.5}, row(2), ["4.", "1.", "2."])
    assert [s.reward for s in steps] == [0.0, 0.0, 0.25] and steps[-1].info["correct"] == 1.0
    _, steps = play({}, row(2), ["9.", "8.", "7.", "6."])  # never right: the runtime cuts it at max_turns, reward 0
    assert not any(s.done for s in steps) and sum(s.reward for s in steps) == 0
    assert [s.observation.text for s in steps] == ["<"] * 4


@pytest.mark.parametrize("text, finish, why", [
    ("7", "length", "hit its token limit"),
    ("07.", "stop", "canonical"),
    ("<.", "stop", "canonical"),
    (".", "stop", "canonical"),
    ("", "stop", "does not end"),
    ("7.7.", "stop", "canonical"),
])
def test_malformed_turns_get_the_error_mark_and_a_reason(text, finish, why):
    env = get_plugin_manager().create("environment", "guess", {})

    async def main():
        await env.reset(row(7), seed=0)
        bad = await env.step(act(0, text, finish))
        good = await env.step(act(1, "7."))
        return bad, good

    bad, good = asyncio.run(main())
    assert bad.observation.text == "?" and not bad.done and bad.reward == 0.0
    assert bad.info["tool_ok"] is False and why in bad.info["reason"]
    assert good.done and good.reward == 1.0  # a malformed turn costs a turn, nothing else


def test_options_are_checked():
    pm = get_plugin_manager()
    with pytest.raises(ConfigError, match="must differ"):
        pm.validate_options("environment", "guess", {"lower": ">"})
    with pytest.raises(ConfigError, match="no digit"):
        pm.validate_options("environment", "guess", {"error_text": "0"})
    with pytest.raises(ConfigError, match="discount"):
        pm.validate_options("environment", "guess", {"discount": 0})


def test_a_row_without_an_integer_secret_fails_reset():
    env = get_plugin_manager().create("environment", "guess", {})
    with pytest.raises(KeyError, match="answer"):
        asyncio.run(env.reset({"prompt": "="}, seed=0))
    with pytest.raises(ValueError, match="must be an integer"):
        asyncio.run(env.reset(row("x"), seed=0))  # type: ignore[arg-type]


def test_single_turn_baseline_scores_one_guess_with_the_arithmetic_reward():
    """The baseline's reward (same records, one guess, no feedback) is exact match of the guess with the secret."""
    pm = get_plugin_manager()
    rec = pm.create("dataset", "guess", {})[0]
    reward = pm.create("reward", "arithmetic", {})
    secret = rec.metadata["answer"]
    other = str((int(secret) + 1) % 10)

    def score(text):
        return reward.score(RewardInput(prompt=rec.prompt, completion=text, metadata=rec.metadata))

    assert score(f"{secret}.")["correct"] == 1.0 and score(f"{other}.")["correct"] == 0.0
    assert score(secret)["reward"] == 0.0  # no terminator: as malformed as in the environment


def test_hermes_variant_offers_the_guess_tool():
    env_turns = [render_hermes_call("guess", {"number": 5}), "I think it is 3",
                 render_hermes_call("guess", {"n": 1}), render_hermes_call("guess", {"number": "3"})]
    obs, steps = play({"format": "hermes"}, row(3, low=0, high=9), env_turns)
    assert obs.messages[0]["role"] == "user" and "between 0 and 9" in obs.messages[0]["content"]
    assert steps[0].observation.messages == [{"role": "tool", "name": "guess", "content": "lower"}]
    assert "no guess tool call" in steps[1].info["reason"]
    assert "unknown argument" in steps[2].observation.messages[0]["content"] and not steps[2].info["tool_ok"]
    assert steps[3].done and steps[3].reward == 1.0
    env = get_plugin_manager().create("environment", "guess", {"format": "hermes"})
    assert [t.name for t in env.tools] == ["guess"]
    assert env.tools[0].parameters["properties"]["number"]["type"] == "integer"


class TestGuessCompact(EnvironmentSpec):
    backend = "guess"
    records = (row(4), {"index": 1, "prompt": "=", "metadata": {"answer": "9", "terminator": "."}})
    turns = ("x.", "4.", "7.", "8.", "9.")


class TestGuessHermes(EnvironmentSpec):
    backend = "guess"
    options = {"format": "hermes"}
    records = TestGuessCompact.records
    turns = ("no call", render_hermes_call("guess", {"number": 4}), render_hermes_call("guess", {"number": 9}))
