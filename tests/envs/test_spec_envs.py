"""The conformance suite (EnvironmentSpec) against every built-in environment."""

from __future__ import annotations

from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_spec import SPEC_CLASSES, EnvironmentSpec


class TestCalculatorCompact(EnvironmentSpec):
    backend = "calculator"


class TestCalculatorHermes(EnvironmentSpec):
    backend = "calculator"
    options = {"format": "hermes"}


class TestToolCallsHermes(EnvironmentSpec):
    backend = "tool_calls"


class TestToolCallsCompactInWorkerProcesses(EnvironmentSpec):
    """Declared blocking: the pool runs it in worker processes, so records, actions and steps cross processes."""

    backend = "tool_calls"
    options = {"format": "compact", "end": ".", "blocking": True}
    turns = ("calc(12*34).", "calc(1,2).", "nope(3).", "4776.")


def test_every_builtin_environment_has_a_spec_class_here():
    # guess: tests/envs/test_guess.py runs TestGuessCompact and TestGuessHermes
    tested = {cls.backend for cls in (TestCalculatorCompact, TestToolCallsHermes)} | {"guess"}
    assert set(get_plugin_manager().registrations(PluginKind.ENVIRONMENT)) <= tested
    assert SPEC_CLASSES[PluginKind.ENVIRONMENT] is EnvironmentSpec
