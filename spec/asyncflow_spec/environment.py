"""Conformance tests for Environment backends (multi-turn episodes).

A backend's test module::

    from asyncflow_spec import EnvironmentSpec

    class TestMyEnv(EnvironmentSpec):
        backend = "my-env"
        options = {...}
        records = ({"index": 0, "prompt": "...", "metadata": {...}},)   # rows its reset accepts
        turns = ("a first turn", "a final answer")                       # scripted policy turns

The suite plays each record with the scripted turns (stopping when a step is
``done``) and checks the contract: reset returns an Observation; every step a
valid Step whose info can be logged; any text the policy may produce is
answered, never raised on; the episode runs through the runtime's
:class:`~asyncflow_core.flow.env_pool.EnvironmentPool` within
``step_timeout_s`` (in worker processes when ``features.blocking``);
a step cancelled by a time-out still lets ``close`` run; the same record,
seed and turns replay identically when ``features.deterministic``; with
``features.restore == "replay"``, a fresh environment reset with the same
record and seed and stepped with the recorded actions answers with the same
observations, rewards and ``done`` (what the runtime checks when it rebuilds a
lost environment); and a row the environment cannot use fails as a recorded,
one-line reason.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from asyncflow_core.errors import EnvironmentFailure
from asyncflow_core.interfaces.environment import (
    Action,
    Environment,
    EnvironmentFeatures,
    Observation,
    Step,
    ToolSpec,
)
from asyncflow_core.plugins import PluginKind
from asyncflow_spec.base import BackendSpec, require, run

#: texts a policy can produce that no environment may raise on (it answers them, e.g. with an error message)
GARBAGE_TURNS = ("", "\ufffd\ufffd", "<tool_call>{", '<tool_call>{"name": 3}</tool_call>', "((((", "x" * 2000,
                 "=.?", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')


def _loggable(info: Mapping[str, Any]) -> bool:
    try:
        json.dumps(dict(info))
    except (TypeError, ValueError):
        return False
    return True


def _replayable(step: Step) -> tuple[Any, ...]:
    """What must repeat under the same seed: timings (``*seconds`` info keys) may differ."""
    info = {k: v for k, v in step.info.items() if not k.endswith("seconds")}
    obs = step.observation
    shown = None if obs is None else (obs.text, json.dumps(obs.messages, sort_keys=True, default=str),
                                      tuple(obs.token_ids) if obs.token_ids is not None else None)
    return shown, step.reward, step.done, json.dumps(info, sort_keys=True, default=str)


class EnvironmentSpec(BackendSpec):
    """Subclass and set ``backend``/``options``; ``records`` and ``turns`` when the defaults do not fit."""

    kind = PluginKind.ENVIRONMENT
    #: dataset rows (mappings of PromptRecord fields) the environment is reset with
    records: ClassVar[tuple[Mapping[str, Any], ...]] = (
        # as the runtime passes a row: its metadata keys beside prompt, index and prompt_token_ids
        {"index": 0, "prompt": "12*34+56*78=", "prompt_token_ids": (), "expression": "12*34+56*78",
         "answer": "4776", "terminator": "."},
        # a nested metadata mapping is accepted too
        {"index": 1, "prompt": "2*3+4=", "metadata": {"expression": "2*3+4", "answer": "10"}},
    )
    #: scripted policy turns, played in order until a step is done
    turns: ClassVar[tuple[str, ...]] = (
        "12*34.",
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>',
        "4776.",
    )
    #: a row the environment cannot use: reset must answer or raise an Exception (recorded as a failure)
    bad_record: ClassVar[Mapping[str, Any]] = {"index": 0, "prompt": "", "prompt_token_ids": ()}
    seeds: ClassVar[tuple[int, ...]] = (0, 1)
    step_timeout_s: ClassVar[float] = 30.0

    async def _new(self, make_backend) -> Environment:
        env = make_backend()  # the registered factory, once per episode as the runtime calls it
        if inspect.isawaitable(env):
            env = await env
        assert isinstance(env, Environment), (
            f"the factory registered for {self.backend!r} must build an Environment; it built {type(env).__name__}")
        return env

    async def _play(self, env: Environment, record: Mapping[str, Any], seed: int) -> tuple[Observation, list[Step]]:
        first = await env.reset(record, seed=seed)
        steps: list[Step] = []
        for turn, text in enumerate(self.turns):
            steps.append(await env.step(Action(token_ids=(), text=text, finish_reason="stop", turn=turn)))
            if steps[-1].done:
                break
        return first, steps

    def test_reset_returns_an_observation_and_declares_tools(self, make_backend):
        """``reset`` returns an Observation; ``tools`` are ToolSpecs with an object JSON schema; features typed."""

        async def main():
            for record in self.records:
                env = await self._new(make_backend)
                try:
                    obs = await env.reset(record, seed=self.seeds[0])
                    assert isinstance(obs, Observation), f"reset returned {type(obs).__name__}, not an Observation"
                    assert isinstance(env.features, EnvironmentFeatures)
                    for spec in env.tools:
                        assert isinstance(spec, ToolSpec), f"tools must be ToolSpec, got {type(spec).__name__}"
                        assert spec.parameters.get("type") == "object", (
                            f"tool {spec.name!r}: parameters must be a JSON schema of type object")
                        json.dumps(spec.as_openai())
                finally:
                    await env.close()

        run(main())

    def test_steps_are_valid_and_loggable(self, make_backend):
        """Every Step: a next observation unless done, a finite float reward, info that json can log."""

        async def main():
            for record in self.records:
                env = await self._new(make_backend)
                try:
                    _, steps = await self._play(env, record, self.seeds[0])
                finally:
                    await env.close()
                assert steps, "set `turns` to at least one scripted policy turn"
                for step in steps:
                    assert isinstance(step, Step), f"step returned {type(step).__name__}, not a Step"
                    assert step.done or isinstance(step.observation, Observation)
                    assert isinstance(step.reward, (int, float)) and math.isfinite(step.reward), step.reward
                    assert isinstance(step.info, Mapping) and _loggable(step.info), (
                        f"step info must be JSON-serialisable (it is logged per episode): {step.info!r}")
                if env.features.owns_reward:
                    assert all(math.isfinite(s.reward) for s in steps)

        run(main())

    def test_any_policy_text_is_answered_not_raised(self, make_backend):
        """Malformed turns (garbage, broken tool calls, cut-off text) get a Step: the policy can write anything."""

        async def main():
            for finish in ("stop", "length"):
                for turn, text in enumerate(GARBAGE_TURNS):
                    env = await self._new(make_backend)
                    try:
                        await env.reset(self.records[0], seed=self.seeds[0])
                        try:
                            step = await env.step(Action(token_ids=(), text=text, finish_reason=finish, turn=0))
                        except Exception as exc:  # noqa: BLE001 - the failure message is the point
                            pytest.fail(f"step raised {type(exc).__name__}: {exc} on the policy text {text[:40]!r}; "
                                        "answer malformed turns with an observation (and an info reason)")
                        assert isinstance(step, Step)
                    finally:
                        await env.close()

        run(main())

    def test_episode_through_the_pool_within_step_timeout(self):
        """The runtime's pool plays the episode (worker processes if features.blocking) within step_timeout_s."""
        from asyncflow_core.flow.env_pool import EnvironmentPool

        async def main():
            pool = EnvironmentPool.from_plugin(self.backend, self.options, step_timeout_s=self.step_timeout_s,
                                               workers=2)
            async with pool:
                for record in self.records:
                    async with pool.episode() as env:
                        try:
                            _, steps = await self._play(env, record, self.seeds[0])
                        except EnvironmentFailure as exc:
                            pytest.fail(f"through the pool (processes={pool.processes}, blocking="
                                        f"{env.features.blocking}): {exc}")
                    calls = [t.call for t in env.timings]
                    assert calls[:2] == ["open", "reset"] and calls[-1] == "close"
                    assert calls.count("step") == len(steps)
                    assert all(0 <= t.seconds for t in env.timings)
                return pool.in_flight

        assert run(main(), timeout=self.step_timeout_s * (len(self.turns) + 3) * len(self.records) + 60) == 0

    def test_close_after_a_cancelled_step(self, make_backend):
        """A step cut by the time limit is cancelled; ``close`` must still run without error afterwards."""

        async def main():
            env = await self._new(make_backend)
            await env.reset(self.records[0], seed=self.seeds[0])
            task = asyncio.ensure_future(env.step(Action((), self.turns[0], "stop", 0)))
            await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await env.close()

        run(main())

    def test_deterministic_under_a_seed(self, make_backend):
        """With features.deterministic: same record, seed and turns give the same observations, rewards, info."""
        features = run(self._features(make_backend))
        require(features, "deterministic")

        async def main():
            for record in self.records:
                for seed in self.seeds:
                    runs = []
                    for _ in range(2):
                        env = await self._new(make_backend)
                        try:
                            first, steps = await self._play(env, record, seed)
                        finally:
                            await env.close()
                        runs.append((first, [_replayable(s) for s in steps]))
                    assert runs[0] == runs[1], f"seed {seed}: two replays differ"

        run(main())

    def test_replay_rebuilds_the_same_observations(self, make_backend):
        """With features.restore == "replay": the episode played once, then a fresh environment reset with the same
        record and seed and stepped with the recorded actions (the very Action objects, token ids and text) gives
        the same first observation and, step by step, the same observation, reward and done."""
        features = run(self._features(make_backend))
        if features.restore != "replay":
            pytest.skip(f"restore is {features.restore!r} in this backend's Features")

        def shown(step: Step) -> tuple[Any, ...]:
            return _replayable(step)[:3]  # observation, reward, done (info may carry timings and names)

        async def main():
            for record in self.records:
                for seed in self.seeds:
                    env = await self._new(make_backend)
                    actions: list[Action] = []
                    recorded: list[Step] = []
                    try:
                        first = await env.reset(record, seed=seed)
                        for turn, text in enumerate(self.turns):
                            action = Action(token_ids=tuple(ord(c) % 97 for c in text), text=text,
                                            finish_reason="stop", turn=turn)
                            actions.append(action)
                            recorded.append(await env.step(action))
                            if recorded[-1].done:
                                break
                    finally:
                        await env.close()
                    fresh = await self._new(make_backend)
                    try:
                        again = await fresh.reset(record, seed=seed)
                        assert _replayable(Step(again)) == _replayable(Step(first)), (
                            f"seed {seed}: reset of a fresh environment gave another first observation")
                        for action, step in zip(actions, recorded):
                            replayed = await fresh.step(action)
                            assert shown(replayed) == shown(step), (
                                f"seed {seed}, turn {action.turn}: the replayed step answers {shown(replayed)}, the "
                                f"recorded one {shown(step)}; restore='replay' needs the same answers")
                    finally:
                        await fresh.close()

        run(main())

    def test_unusable_row_is_a_recorded_failure(self):
        """A row reset cannot use raises an Exception, which the pool records as a one-line reason (or it answers)."""
        from asyncflow_core.flow.env_pool import EnvironmentPool

        async def main():
            pool = EnvironmentPool.from_plugin(self.backend, self.options, step_timeout_s=self.step_timeout_s)
            async with pool:
                try:
                    async with pool.episode() as env:
                        obs = await env.reset(self.bad_record, seed=0)
                        assert isinstance(obs, Observation)
                except EnvironmentFailure as exc:
                    assert exc.call == "reset" and "\n" not in exc.reason and exc.reason.startswith(
                        "environment reset failed: "), exc.reason
                return pool.in_flight

        assert run(main()) == 0

    async def _features(self, make_backend) -> EnvironmentFeatures:
        env = await self._new(make_backend)
        try:
            return env.features
        finally:
            await env.close()
