"""@tool specs from hints and docstrings; the hermes and compact call formats; malformed calls never raise."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from asyncflow_plugins.envs.tools import (
    Tool,
    parse_compact,
    parse_docstring,
    parse_hermes,
    render_hermes_call,
    tool,
)


@tool
def lookup(city: str, days: int = 1, unit: Literal["c", "f"] = "c", hourly: bool = False) -> dict:
    """Weather forecast for a city.

    More text that is not the description's first paragraph.

    Args:
        city: Name of the city,
            continued on a second line.
        days: How many days ahead.
        unit: Temperature unit.

    Returns:
        The forecast.
    """
    return {"city": city, "days": days, "unit": unit, "hourly": hourly}


@tool(name="sleepy", description="Waits, then answers.")
async def slow(n: int) -> str:
    await asyncio.sleep(0)
    return str(n * 2)


def test_spec_from_hints_and_docstring():
    spec = lookup.spec
    assert spec.name == "lookup" and spec.description == "Weather forecast for a city."
    props = spec.parameters["properties"]
    assert props["city"] == {"type": "string", "description": "Name of the city, continued on a second line."}
    assert props["days"] == {"type": "integer", "description": "How many days ahead."}
    assert props["unit"] == {"enum": ["c", "f"], "description": "Temperature unit."}
    assert props["hourly"] == {"type": "boolean"}
    assert spec.parameters["required"] == ["city"]
    assert spec.as_openai()["function"]["name"] == "lookup"
    assert slow.spec.name == "sleepy" and slow.spec.description == "Waits, then answers."


def test_docstring_without_args_section():
    assert parse_docstring("Adds.\n\nLonger.") == ("Adds.", {})


def test_untyped_argument_is_refused():
    def f(x):
        return x

    with pytest.raises(TypeError, match="needs a type hint"):
        Tool(f)


def test_invoke_validates_converts_and_reports():
    ok = asyncio.run(lookup.invoke({"city": "Oslo", "days": "3"}))
    assert ok.ok and '"days": 3' in ok.content
    bad = asyncio.run(lookup.invoke({"town": "Oslo"}))
    assert not bad.ok and "city: Field required" in bad.content and "town: unknown argument" in bad.content
    wrong = asyncio.run(lookup.invoke({"city": "Oslo", "unit": "k"}))
    assert not wrong.ok and wrong.content.startswith("bad arguments for lookup: unit:")
    assert asyncio.run(slow.invoke({"n": 4})).content == "8"

    @tool
    def explode(x: int) -> str:
        """Fails."""
        raise ZeroDivisionError("no")

    failed = asyncio.run(explode.invoke({"x": 1}))
    assert not failed.ok and failed.content == "explode failed: ZeroDivisionError: no"


TOOLS = {t.name: t for t in (lookup, slow)}


def test_hermes_calls_and_the_rest_of_the_text():
    text = "Let me check. " + render_hermes_call("lookup", {"city": "Oslo"}) + " and " + \
        '<tool_call>{"name": "sleepy", "arguments": "{\\"n\\": 2}"}</tool_call>'
    parsed = parse_hermes(text, TOOLS)
    assert [(c.name, dict(c.arguments), c.error) for c in parsed.calls] == [
        ("lookup", {"city": "Oslo"}, None), ("sleepy", {"n": 2}, None)]
    assert parsed.text == "Let me check.  and"


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["lookup"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool 'nope'; available: lookup, sleepy"),
    ('<tool_call>{"name": "lookup", "arguments": 3}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "lookup", "arguments": {"city": "x"}}', "is not closed"),
])
def test_malformed_hermes_calls_carry_the_reason(text, error):
    (call,) = parse_hermes(text, TOOLS).calls
    assert call.error is not None and error in call.error


def test_no_call_is_an_answer():
    assert parse_hermes("The answer is 4.", TOOLS).calls == ()
    assert parse_compact("42.", TOOLS, end=".").text == "42"


def test_compact_calls():
    (call,) = parse_compact("lookup(Oslo,3).", TOOLS, end=".").calls
    assert (call.name, dict(call.arguments)) == ("lookup", {"city": "Oslo", "days": "3"})
    (call,) = parse_compact("lookup('a,b')", TOOLS).calls
    assert dict(call.arguments) == {"city": "a,b"}
    (call,) = parse_compact("nope(1)", TOOLS).calls
    assert "unknown tool 'nope'" in call.error
    (call,) = parse_compact("sleepy(1,2)", TOOLS).calls
    assert call.error == "sleepy takes 1 argument(s), got 2"
    (call,) = parse_compact("12*34.", TOOLS, end=".", default_tool="lookup").calls
    assert dict(call.arguments) == {"city": "12*34"}
