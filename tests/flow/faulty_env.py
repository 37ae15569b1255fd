"""A faulty environment plugin for run-level tests: each dataset row's fault is picked by the row's index.

Register it in a test with a fresh plugin manager (the ``fresh_plugins``
fixture), then run with ``environment.name: faulty``::

    get_plugin_manager().register_module("tests.flow.faulty_env", distribution="tests")

``options.faults`` lists one fault per dataset index (cycled): ``ok`` (a
few turns, reward 1 at the end), ``raise`` (step 1 raises), ``timeout``
(step 0 never returns), ``malformed`` (every turn is read as a malformed
tool call: answered with what was wrong, ``tool_ok`` false and a ``reason``,
as ``ToolEnvironment`` answers one; the episode goes on) and ``oversize``
(step 0 answers with an observation of ``oversize_chars`` characters).
Observations use only the toy engines' first 16 characters of the default
alphabet (digits and ``+-*/=(``), so the toy trainer accepts every token.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces.environment import Action, Environment, EnvironmentFeatures, Observation, Step
from asyncflow_core.plugins import EnvironmentBackend, hookimpl

KINDS = ("ok", "raise", "timeout", "malformed", "oversize")
#: failures with a recorded reason (the episode's row fails, its group is dropped), as patterns of the reason;
#: ``malformed`` is answered. An environment call goes through the run's environment pool, whose own line
#: ("environment step (turn N) failed: ...") is the reason; a call the episode's own timer ends first reads
#: "environment step N took longer than ...".
FAILING = {
    "raise": r"environment step (1 raised|\(turn 1\) failed:) RuntimeError: "
             r"sandbox of row (?P<index>\d+) crashed",
    "timeout": r"environment step (0 took longer than|\(turn 0\) timed out after) "
               r"(?P<seconds>[\d.]+)s",
    "oversize": r"oversize episode: (?P<tokens>\d+) tokens after turn 0's observation, no room under "
                r"max_episode_tokens=(?P<limit>\d+)",
}
MALFORMED_REASON = "malformed tool call: no closing parenthesis"


class FaultyConfig(BaseModel):
    """Options of the ``faulty`` test environment."""

    model_config = ConfigDict(extra="forbid")

    faults: list[str] = Field(default_factory=lambda: list(KINDS), description="The fault of dataset index i is "
                              "faults[i % len(faults)]: ok, raise, timeout, malformed or oversize.")
    turns: int = Field(3, ge=1, description="Steps an ok or malformed episode takes before it is done.")
    oversize_chars: int = Field(32, ge=1, description="Length of the oversize observation.")


def fault_of(index: int, faults: list[str]) -> str:
    return faults[index % len(faults)]


class FaultyEnvironment(Environment):
    """One episode; see the module docstring."""

    features = EnvironmentFeatures(owns_reward=True)

    def __init__(self, config: FaultyConfig) -> None:
        for kind in config.faults:
            if kind not in KINDS:
                raise ValueError(f"unknown fault {kind!r}; use one of {', '.join(KINDS)}")
        self.config = config
        self.kind = "ok"
        self.index = -1

    async def reset(self, record, *, seed):
        self.index = int(record["index"])
        self.kind = fault_of(self.index, self.config.faults)
        return Observation(text=record["prompt"])  # the dataset's prompt: its stored tokens are reused

    async def step(self, action: Action) -> Step:
        kind, turn = self.kind, action.turn
        if kind == "raise" and turn == 1:
            raise RuntimeError(f"sandbox of row {self.index} crashed")
        if kind == "timeout" and turn == 0:
            await asyncio.sleep(3600)
        if kind == "oversize" and turn == 0:
            return Step(Observation(text="7" * self.config.oversize_chars), reward=0.0)
        done = turn + 1 >= self.config.turns
        info: dict = {"tool_calls": 1, "tool_ok": kind != "malformed"}
        if kind == "malformed":
            info["reason"] = MALFORMED_REASON
        return Step(None if done else Observation(text="(" if kind == "malformed" else "="),
                    reward=1.0 if done else 0.0, done=done, info=info)

    async def close(self) -> None:
        pass


def _factory(config: FaultyConfig) -> FaultyEnvironment:
    return FaultyEnvironment(config)


@hookimpl
def asyncflow_environments():
    yield EnvironmentBackend(
        name="faulty", factory=_factory, config_model=FaultyConfig,
        description="Test environment: per dataset row ok, raise, timeout, malformed tool call or oversize.",
        features=EnvironmentFeatures(owns_reward=True),
    )
