"""Built-in environments: ``tool_calls`` (any typed tools), ``calculator`` (tool use: multi-operand arithmetic
solved with a calc tool) and ``guess`` (the learnable multi-turn example: a hidden digit found with ``<``/``>``
feedback each turn; examples/agent_guess.yaml).

Also the ``calculator`` and ``guess`` datasets that generate their tasks' rows.
Writing a tool: :func:`asyncflow_plugins.envs.tools.tool`; serving tools to a
model: :class:`ToolEnvironment`.
"""

from __future__ import annotations

import functools

from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncflow_core.interfaces.environment import EnvironmentFeatures
from asyncflow_core.plugins import DatasetBackend, EnvironmentBackend, hookimpl
from asyncflow_plugins.envs.tool_env import ToolEnvironment, load_tool
from asyncflow_plugins.envs.tools import CallFormat, Tool, ToolCall, ToolResult, parse_calls, tool

__all__ = ["CallFormat", "Tool", "ToolCall", "ToolEnvironment", "ToolResult", "load_tool", "parse_calls", "tool"]


class ToolCallsConfig(BaseModel):
    """Options of the ``tool_calls`` environment."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=lambda: ["asyncflow_plugins.envs.calculator:calc"],
        description="Tools offered, as 'package.module:function' (a @tool function, or a typed, documented one).",
    )
    format: CallFormat = Field(CallFormat.HERMES, description="hermes (<tool_call> JSON blocks, Qwen2.5) or compact "
                               "(name(arg,arg), for a character tokenizer).")
    max_calls_per_turn: int = Field(4, ge=1, description="Calls run per turn; more are reported as an error.")
    end: str = Field("", description="compact: the stop character ending each turn, stripped before parsing.")
    result_template: str = Field("{result}", description="How a result is shown ('{result}'); compact turns get "
                                 "it as text, chat models as a tool message.")
    error_template: str = Field("error: {reason}", description="How a bad call is shown ('{reason}').")
    blocking: bool = Field(False, description="The tools block (CPU-bound or blocking I/O): declare "
                           "features.blocking so the runtime runs episodes in worker processes.")
    deterministic: bool = Field(True, description="The tools return the same result for the same arguments, and "
                                "may run again with the same effect: the environment then declares restore: replay "
                                "(a lost one is rebuilt by replaying the episode's turns); off: restore: reset.")

    @field_validator("tools")
    @classmethod
    def _importable(cls, value: list[str]) -> list[str]:
        for path in value:
            load_tool(path)  # ValueError names the bad entry
        return value


@functools.lru_cache(maxsize=64)
def _tools(paths: tuple[str, ...]) -> tuple[Tool, ...]:
    return tuple(load_tool(p) for p in paths)  # imported once per process, not once per episode


def _tool_calls(config: ToolCallsConfig) -> ToolEnvironment:
    """One ToolEnvironment (one episode); its features say what the options make of it."""
    features = EnvironmentFeatures(owns_reward=False, deterministic=config.deterministic, blocking=config.blocking,
                                   restore="replay" if config.deterministic else "reset")
    return ToolEnvironment(list(_tools(tuple(config.tools))), call_format=config.format, features=features,
                           max_calls_per_turn=config.max_calls_per_turn, end_text=config.end,
                           result_template=config.result_template, error_template=config.error_template)


def _calculator(config):
    from asyncflow_plugins.envs.calculator import CalculatorEnvironment

    return CalculatorEnvironment(config)


def _guess(config):
    from asyncflow_plugins.envs.guess import GuessEnvironment

    return GuessEnvironment(config)


def _guess_dataset(config):
    from asyncflow_plugins.envs.guess import GuessDataset

    return GuessDataset(config)


def _calculator_dataset(config):
    from asyncflow_plugins.envs.calculator import CalculatorDataset

    return CalculatorDataset(config)


@hookimpl(tryfirst=True)
def asyncflow_environments():
    from asyncflow_plugins.envs.calculator import CalculatorEnvConfig
    from asyncflow_plugins.envs.guess import GuessEnvConfig

    yield EnvironmentBackend(
        name="tool_calls", factory=_tool_calls, config_model=ToolCallsConfig,
        description="Runs the tool calls in the model's output (hermes or compact format) until it answers.",
        features=EnvironmentFeatures(owns_reward=False, restore="replay"),
    )
    yield EnvironmentBackend(
        name="calculator", factory=_calculator, config_model=CalculatorEnvConfig,
        description="Multi-operand arithmetic solved with a one-operation calc tool over several turns.",
        features=EnvironmentFeatures(owns_reward=True, restore="replay"),
    )
    yield EnvironmentBackend(
        name="guess", factory=_guess, config_model=GuessEnvConfig,
        description="Find a hidden number with '<'/'>' feedback each turn (the multi-turn example task).",
        features=EnvironmentFeatures(owns_reward=True, restore="replay"),
    )


@hookimpl
def asyncflow_datasets():
    from asyncflow_plugins.envs.calculator import CalculatorDataConfig
    from asyncflow_plugins.envs.guess import GuessDataConfig

    yield DatasetBackend(
        name="calculator", factory=_calculator_dataset, config_model=CalculatorDataConfig,
        description="Generated problems such as '12*34+56*78=' for the calculator environment, seeded.",
    )
    yield DatasetBackend(
        name="guess", factory=_guess_dataset, config_model=GuessDataConfig,
        description="Seeded hidden numbers for the guess environment (prompt without the secret).",
    )
