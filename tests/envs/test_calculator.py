"""The calculator task: dataset, one-operation tool, solved and failed episodes in both formats."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import Action
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_plugins.envs.calculator import CalcError, evaluate, solve_compact
from asyncflow_plugins.envs.tools import render_hermes_call


def act(turn: int, text: str) -> Action:
    return Action(token_ids=(), text=text, finish_reason="stop", turn=turn)


def play(options: dict, record, turns: list[str]):
    env = get_plugin_manager().create("environment", "calculator", options)

    async def main():
        obs = await env.reset(record, seed=0)
        steps = []
        for t, text in enumerate(turns):
            steps.append(await env.step(act(t, text)))
            if steps[-1].done:
                break
        return obs, steps

    return asyncio.run(main())


@given(st.lists(st.integers(0, 999), min_size=1, max_size=5), st.lists(st.sampled_from("+-*"), min_size=4,
                                                                        max_size=4))
def test_evaluate_matches_python(nums, ops):
    text = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
    assert evaluate(text)[0] == eval(text)  # noqa: S307 - digits and + - * only
    assert evaluate(text)[1] == len(nums) - 1


@pytest.mark.parametrize("text", ["", "1+", "2**3", "(1", "1/2", "a", "1" * 13])
def test_evaluate_refuses(text):
    with pytest.raises(CalcError):
        evaluate(text)


def test_dataset_is_seeded_and_fits_the_tiny_alphabet():
    pm = get_plugin_manager()
    ds = pm.create("dataset", "calculator", {"size": 50})
    again = pm.create("dataset", "calculator", {"size": 50})
    other = pm.create("dataset", "calculator", {"size": 50, "seed": 1})
    assert [ds[i] for i in range(50)] == [again[i] for i in range(50)] != [other[i] for i in range(50)]
    alphabet = set("0123456789+-*=.?")
    for i in range(50):
        rec = ds[i]
        a, b, c, d = (int(x) for x in rec.metadata["expression"].replace("*", "+").split("+"))
        assert all(10 <= x <= 99 for x in (a, b, c, d)) and int(rec.metadata["answer"]) == a * b + c * d
        transcript = rec.prompt + "".join(t + f"{evaluate(t[:-1])[0]}=" for t in solve_compact(rec)[:-1])
        assert set(transcript) <= alphabet
    with pytest.raises(ConfigError, match="pattern"):
        pm.validate_options("dataset", "calculator", {"pattern": "N**N"})


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 9_999), st.sampled_from(["N*N+N*N", "N+N*N", "N-N*N+N", "N*N*N"]))
def test_scripted_solution_earns_the_reward(index, pattern):
    rec = get_plugin_manager().create("dataset", "calculator", {"pattern": pattern})[index]
    turns = solve_compact(rec)
    obs, steps = play({}, rec, turns)
    assert obs.text == rec.prompt
    assert len(steps) == len(turns) and steps[-1].done and steps[-1].reward == 1.0
    assert all(s.info["tool_ok"] for s in steps[:-1]) and sum(s.reward for s in steps[:-1]) == 0


def test_wrong_answer_bad_calls_and_shaping():
    rec = {"prompt": "12*34+56*78=", "metadata": {"expression": "12*34+56*78", "answer": "4776"}}
    obs, steps = play({"call_reward": 0.1}, rec, ["12*34+56*78.", "12*.", "12*34.", "56*78.", "1*1.", "408+4368.",
                                                  "4777."])
    bad_whole, bad_syntax = steps[0], steps[1]
    assert bad_whole.observation.text == "?=" and not bad_whole.info["tool_ok"]
    assert "3 operations in one call" in bad_whole.info["reason"] and bad_whole.reward == 0
    assert "ends too early" in bad_syntax.info["reason"]
    # three operations in the problem: at most three calls are shaped, however many are made
    assert [s.reward for s in steps[2:6]] == [0.1, 0.1, 0.1, 0.0]
    assert steps[-1].done and steps[-1].reward == 0.0 and steps[-1].info["correct"] == 0.0


def test_hermes_episode():
    rec = {"prompt": "12*34+56*78=", "metadata": {"expression": "12*34+56*78", "answer": "4776"}}
    turns = [render_hermes_call("calc", {"expression": "12*34"}),
             render_hermes_call("calc", {"expression": "56*78"}) + render_hermes_call("calc", {"expr": "1"}),
             render_hermes_call("calc", {"expression": "408+4368"}),
             "So the result is 4776"]
    obs, steps = play({"format": "hermes"}, rec, turns)
    assert obs.messages[0]["role"] == "user" and "12*34+56*78" in obs.messages[0]["content"]
    assert steps[0].observation.messages == [{"role": "tool", "name": "calc", "content": "408"}]
    second = steps[1]
    assert [m["content"] for m in second.observation.messages][0] == "4368"
    assert "unknown argument" in second.observation.messages[1]["content"] and not second.info["tool_ok"]
    assert steps[-1].done and steps[-1].reward == 1.0
