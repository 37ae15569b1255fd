"""The ``calculator`` environment and dataset: multi-operand arithmetic solved with a calc tool, turn by turn.

A problem such as ``12*34+56*78`` is beyond a tiny model trained from random
weights on a CPU (four-digit products, then a sum), but each step is within
reach when it can ask a tool: the ``calc`` tool evaluates *one operation per
call* (``max_ops_per_call``), so the model must call it on the
sub-expressions, read each result, combine them, and answer.

Two formats:

- ``compact`` (character tokenizer). The prompt is the dataset's text, e.g.
  ``12*34+56*78=``. Every turn ends with the stop character ``end`` (``.``).
  A turn that is an integer is the final answer; any other turn is a call of
  ``calc`` on its text. A result comes back as ``<result>=``, a bad call as
  ``<error_text>=``. A solved episode reads::

      12*34+56*78=12*34.408=56*78.4368=408+4368.4776=4776.

  Characters used: digits, ``+-*``, ``=``, ``end`` and ``error_text``: with the
  defaults ``model.alphabet: "0123456789+-*=.?"``.
- ``hermes`` (a chat model): the prompt is a user message and the tool is
  offered through the chat template; calls are ``<tool_call>`` blocks,
  results ``tool`` messages, and the final answer is the last integer of a
  turn without a call.

Reward (the environment owns it): 1 when the final answer equals the
record's answer, else 0, given on the last step. Optional shaping,
``call_reward`` (default 0): each well-formed call that the tool evaluates
earns that much, for at most as many calls as the problem has operations, so
shaping alone can never add up to a solved episode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import string
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow_core.interfaces import Dataset
from asyncflow_core.interfaces.environment import Action, EnvironmentFeatures, Observation, Step
from asyncflow_core.types import PromptRecord
from asyncflow_plugins.envs.tool_env import ToolEnvironment, record_field, record_prompt
from asyncflow_plugins.envs.tools import CallFormat, ParsedTurn, Tool, ToolCall, ToolResult, parse_hermes, tool

MAX_NUMBER_DIGITS = 12  #: longest integer literal the calculator reads (keeps results small)

_TOKEN = re.compile(r"\s*(\d+|[-+*()])")


class CalcError(ValueError):
    """An expression the calculator does not accept (the message says why)."""


def evaluate(expression: str, *, max_ops: int | None = None) -> tuple[int, int]:
    """``(value, operations)`` of an integer expression over ``+ - *`` and parentheses (unary minus allowed).

    ``*`` binds tighter than ``+`` and ``-``, left to right. ``CalcError`` for
    anything else, for an integer longer than :data:`MAX_NUMBER_DIGITS` digits,
    or for more than ``max_ops`` binary operations.
    """
    text = expression.strip()
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise CalcError(f"cannot read {text[pos:pos + 8]!r}: use integers, + - * and parentheses")
        tokens.append(match.group(1))
        pos = match.end()
        if pos < len(text) and text[pos:].strip() == "":
            break
    if not tokens:
        raise CalcError("empty expression")
    ops = 0
    i = 0

    def peek() -> str | None:
        return tokens[i] if i < len(tokens) else None

    def take() -> str:
        nonlocal i
        if i >= len(tokens):
            raise CalcError("the expression ends too early")
        i += 1
        return tokens[i - 1]

    def factor() -> int:
        tok = take()
        if tok == "-":
            return -factor()
        if tok == "(":
            value = expr()
            if take() != ")":
                raise CalcError("a '(' is not closed")
            return value
        if tok.isdigit():
            if len(tok) > MAX_NUMBER_DIGITS:
                raise CalcError(f"{tok[:6]}... has more than {MAX_NUMBER_DIGITS} digits")
            return int(tok)
        raise CalcError(f"expected a number, got {tok!r}")

    def term() -> int:
        nonlocal ops
        value = factor()
        while peek() == "*":
            take()
            ops += 1
            value *= factor()
        return value

    def expr() -> int:
        nonlocal ops
        value = term()
        while peek() in ("+", "-"):
            op = take()
            ops += 1
            rhs = term()
            value = value + rhs if op == "+" else value - rhs
        return value

    value = expr()
    if i != len(tokens):
        raise CalcError(f"unexpected {tokens[i]!r}")
    if max_ops is not None and ops > max_ops:
        raise CalcError(f"{ops} operations in one call; the calculator does {max_ops} per call")
    return value, ops


@tool
def calc(expression: str) -> str:
    """Evaluate an integer expression with + - * and parentheses, e.g. 12*34+5.

    Args:
        expression: The expression to evaluate, using integers, + - * and parentheses.
    """
    try:
        return str(evaluate(expression)[0])
    except CalcError as exc:
        raise ValueError(str(exc)) from None


def _one_op_calc(max_ops: int) -> Tool:
    def calc(expression: str) -> str:  # noqa: D417 - documented below through the Tool description
        try:
            return str(evaluate(expression, max_ops=max_ops)[0])
        except CalcError as exc:
            raise ValueError(str(exc)) from None

    what = "one operation" if max_ops == 1 else f"at most {max_ops} operations"
    calc.__doc__ = f"""Evaluate {what} on integers with + - *, e.g. 12*34.

    Args:
        expression: Integers joined by + - * ({what}).
    """
    return Tool(calc, name="calc")


class CalculatorEnvConfig(BaseModel):
    """Options of the ``calculator`` environment."""

    model_config = ConfigDict(extra="forbid")

    format: CallFormat = Field(CallFormat.COMPACT, description="compact (character tokenizer) or hermes (chat "
                               "models: <tool_call> blocks and tool messages).")
    max_ops_per_call: int = Field(1, ge=1, description="Operations one calc call evaluates; more is a bad call "
                                  "(1: the model must split the problem into its operations).")
    end: str = Field(".", description="compact: the stop character that ends every turn (the run's model.eos).")
    error_text: str = Field("?", description="compact: what a bad call is answered with (before '='); the full "
                            "reason goes to the step's info.")
    call_reward: float = Field(0.0, ge=0.0, lt=1.0, description="Shaping: reward per call the tool evaluates, for "
                               "at most as many calls as the problem has operations. 0 disables it.")
    answer_key: str = Field("answer", description="Row field (or metadata key) holding the expected integer.")
    expression_key: str = Field("expression", description="Row field (or metadata key) holding the expression "
                                "(hermes prompts and the shaping cap).")

    @field_validator("end", "error_text")
    @classmethod
    def _not_an_answer(cls, value: str) -> str:
        if not value or any(c in "0123456789+-*=" for c in value):
            raise ValueError(f"{value!r} must be non-empty and use no digit, operator or '='")
        return value


_INTEGER = re.compile(r"-?\d+")


class CalculatorEnvironment(ToolEnvironment):
    """One calculator episode (see the module docstring)."""

    def __init__(self, config: CalculatorEnvConfig) -> None:
        self.config = config
        super().__init__(
            [_one_op_calc(config.max_ops_per_call)],
            call_format=config.format,
            features=EnvironmentFeatures(owns_reward=True, deterministic=True, blocking=False, restore="replay"),
            max_calls_per_turn=4,
            end_text=config.end if config.format is CallFormat.COMPACT else "",
            result_template="{result}=" if config.format is CallFormat.COMPACT else "{result}",
            error_template=f"{config.error_text}=" if config.format is CallFormat.COMPACT else "error: {reason}",
        )
        self.expected: int | None = None
        self.operations = 0
        self.rewarded_calls = 0

    def prompt(self, record: Any) -> Observation:
        self.expected = int(str(record_field(record, self.config.answer_key)).strip())
        try:
            expression = str(record_field(record, self.config.expression_key))
            self.operations = evaluate(expression)[1]
        except (KeyError, CalcError):
            expression, self.operations = "", 0
        self.rewarded_calls = 0
        text, messages = record_prompt(record)
        if self.call_format is CallFormat.COMPACT:
            return Observation(text=text)
        if messages:
            return Observation(messages=messages)
        what = "one operation" if self.config.max_ops_per_call == 1 else "a few operations"
        return Observation(messages=[{"role": "user", "content": (
            f"What is {expression or text}? The calc tool does {what} per call: call it on the parts, "
            "then answer with the number alone.")}])

    def parse(self, action: Action) -> ParsedTurn:
        if self.call_format is CallFormat.HERMES:
            return parse_hermes(action.text, self._tools)
        body = action.text[: -len(self.config.end)] if action.text.endswith(self.config.end) else action.text
        if _INTEGER.fullmatch(body.strip()):
            return ParsedTurn((), body.strip())
        return ParsedTurn((ToolCall("calc", {"expression": body}, body),), "")

    def score(self, answer: str, action: Action) -> tuple[float, dict[str, Any]]:
        found = _INTEGER.findall(answer)
        if not found:
            return 0.0, {"correct": 0.0, "reason": "no integer in the answer"}
        correct = int(found[-1]) == self.expected
        return float(correct), {"correct": float(correct)}

    async def step(self, action: Action) -> Step:
        """The tool environment's step; a turn of tool calls reports ``correct: 0`` (not answered yet), so an
        episode cut at ``max_turns`` while still calculating counts as not correct (``episode/correct``)."""
        step = await super().step(action)
        if "correct" in step.info:
            return step
        return dataclasses.replace(step, info={**step.info, "correct": 0.0})

    def call_reward(self, call: ToolCall, result: ToolResult) -> float:
        if not result.ok or self.config.call_reward == 0 or self.rewarded_calls >= self.operations:
            return 0.0
        self.rewarded_calls += 1
        return self.config.call_reward


# -- the dataset ----------------------------------------------------------------------------------------


class CalculatorDataConfig(BaseModel):
    """Options of the ``calculator`` dataset."""

    model_config = ConfigDict(extra="forbid")

    pattern: str = Field("N*N+N*N", description="Expression shape: each 'N' becomes a random integer; "
                         "the rest (+ - * and parentheses) is kept.")
    min_digits: int = Field(2, ge=1, le=6, description="Fewest digits of a number.")
    max_digits: int = Field(2, ge=1, le=6, description="Most digits of a number (never with leading zeros).")
    size: int = Field(10000, ge=1, description="Number of records.")
    seed: int = Field(0, description="Record i is a function of (seed, i) only.")
    template: str = Field("{expression}=", description="Prompt format around '{expression}'.")
    end: str = Field(".", description="The character that ends every turn; the dataset's stop_text.")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        probe = value.replace("N", "1")
        try:
            evaluate(probe)
        except CalcError as exc:
            raise ValueError(f"{value!r} is not an expression of N, + - * and parentheses ({exc})") from None
        return value

    @model_validator(mode="after")
    def _checks(self) -> CalculatorDataConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) is larger than max_digits ({self.max_digits})")
        names = {n for _, n, _, _ in string.Formatter().parse(self.template) if n is not None}
        if names != {"expression"}:
            raise ValueError("template must contain '{expression}' and no other placeholder")
        return self


class CalculatorDataset(Dataset):
    """Generated problems for the calculator environment; record i depends only on (seed, i).

    ``metadata`` holds ``expression``, ``answer`` (canonical integer) and
    ``terminator`` (the turn-ending character, so the single-turn
    ``arithmetic`` reward can score the same records as a baseline).
    """

    def __init__(self, config: CalculatorDataConfig) -> None:
        self.config = config
        self.stop_text: str = config.end

    def __len__(self) -> int:
        return self.config.size

    def _draw(self, index: int, count: int, low: int, high: int) -> int:
        key = f"asyncflow-calculator/{self.config.seed}/{index}/{count}".encode()
        return low + int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little") % (high - low + 1)

    def __getitem__(self, index: int) -> PromptRecord:
        cfg = self.config
        if not 0 <= index < cfg.size:
            raise IndexError(f"record {index} out of range for {cfg.size} records")
        parts: list[str] = []
        draws = 0
        for ch in cfg.pattern:
            if ch != "N":
                parts.append(ch)
                continue
            digits = self._draw(index, draws, cfg.min_digits, cfg.max_digits)
            low = 0 if digits == 1 else 10 ** (digits - 1)
            parts.append(str(self._draw(index, draws + 1, low, 10**digits - 1)))
            draws += 2
        expression = "".join(parts)
        answer = str(evaluate(expression)[0])
        return PromptRecord(index=index, prompt=cfg.template.format(expression=expression),
                            metadata={"expression": expression, "answer": answer, "terminator": cfg.end})


def solve_compact(record: Mapping[str, Any] | PromptRecord, *, end: str = ".") -> list[str]:
    """The turns of a solved compact episode (one call per operation, left to right, then the answer).

    For tests and for the example's scripted check; it follows the same
    precedence as :func:`evaluate` for patterns of ``+ - *`` without parentheses.
    """
    expression = str(record_field(record, "expression"))
    tokens = _TOKEN.findall(expression)
    if "(" in tokens:
        raise ValueError("solve_compact handles expressions without parentheses")
    # multiply first, then add/subtract left to right
    terms: list[str] = [tokens[0]]
    signs: list[str] = []
    turns: list[str] = []
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            left = terms.pop()
            turns.append(f"{left}*{num}{end}")
            terms.append(str(evaluate(f"{left}*{num}")[0]))
        else:
            signs.append(op)
            terms.append(num)
    acc = terms[0]
    for op, term in zip(signs, terms[1:]):
        turns.append(f"{acc}{op}{term}{end}")
        acc = str(evaluate(f"{acc}{op}{term}")[0])
    return [*turns, f"{acc}{end}"]
