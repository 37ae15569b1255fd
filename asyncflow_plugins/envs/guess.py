"""The ``guess`` environment and dataset: find a hidden number with feedback each turn.

The record holds a secret integer in ``low..high`` (0..9 by default), drawn
from the dataset's seed and index and *not* shown in the prompt. Each turn
the policy guesses; the environment answers where the secret lies:

- ``compact`` (character tokenizer). A turn is a canonical integer followed
  by the stop character ``end`` (``.``). The answer is one character: ``<``
  (the secret is lower than the guess) or ``>`` (higher); a malformed turn
  (anything else, or a turn cut before its stop character) gets ``?`` and
  the reason in the step's info. A correct guess ends the episode. With the
  defaults, a solved episode reads::

      =4.<1.>2.   (secret 2: three turns)

  Characters used: digits, ``<>?``, the prompt's and ``end``: with the
  defaults ``model.alphabet: "0123456789<>?=."``.
- ``hermes`` (a chat model): the prompt is a user message naming the range,
  the guess is a call of the ``guess`` tool (``<tool_call>`` block), and the
  answers are ``tool`` messages (``lower``, ``higher``, or what was wrong).

Reward (the environment owns it): a correct guess at turn ``t`` (0-based)
earns ``discount ** t`` (1 by default), every other turn 0; an episode cut
at ``environment.max_turns`` earns 0. Each turn's info reports it as one call
of the game (``tool_calls: 1``, ``tool_ok``: the guess was well-formed,
``tool_seconds``: how long the answer took), so the run's tool-call success
rate is the rate of well-formed guesses, and ``correct`` (1 for the right
guess, else 0), so an episode's last step says whether it was solved
(``episode/correct``). ``step_delay_s: [lo, hi]`` makes every step wait a
uniform lo..hi seconds first, like a slow tool (benchmarks/agent_tools.py).

Why it needs the turns: the prompt says nothing about the secret, so one
guess (the single-turn baseline: the same dataset scored by the
``arithmetic`` reward) is right with probability at most
``1 / (high - low + 1)`` whatever the policy; with the feedback, binary
search finds any of 10 values within 4 turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import re
import string
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow_core.interfaces import Dataset
from asyncflow_core.interfaces.environment import (
    Action,
    Environment,
    EnvironmentFeatures,
    Observation,
    Step,
    ToolSpec,
)
from asyncflow_core.types import PromptRecord
from asyncflow_plugins.envs.tool_env import record_field, record_prompt
from asyncflow_plugins.envs.tools import CallFormat, Tool, parse_hermes

_CANONICAL = re.compile(r"0|[1-9][0-9]*")


def _guess(number: int) -> str:  # the hermes variant's tool; the environment answers it, never this body
    """Guess the secret number; the answer says whether it is lower, higher or correct.

    Args:
        number: Your guess, an integer in the range the prompt names.
    """
    return str(number)


_GUESS_TOOL = Tool(_guess, name="guess")


class GuessEnvConfig(BaseModel):
    """Options of the ``guess`` environment."""

    model_config = ConfigDict(extra="forbid")

    format: CallFormat = Field(CallFormat.COMPACT, description="compact (character tokenizer: a guess is digits "
                               "and the stop character) or hermes (chat models: a call of the guess tool).")
    end: str = Field(".", description="compact: the stop character that ends every turn (the run's model.eos).")
    lower: str = Field("<", description="compact: the answer when the secret is lower than the guess.")
    higher: str = Field(">", description="compact: the answer when the secret is higher than the guess.")
    error_text: str = Field("?", description="compact: the answer to a malformed turn (the reason goes to info).")
    discount: float = Field(1.0, gt=0.0, le=1.0, description="A correct guess at turn t (0-based) earns "
                            "discount**t; 1: any correct guess earns 1.")
    answer_key: str = Field("answer", description="Row field (or metadata key) holding the secret integer.")
    step_delay_s: tuple[float, float] = Field((0.0, 0.0), description="[lo, hi]: each step first sleeps (awaits) "
                                              "a duration drawn uniformly from lo..hi seconds, like a slow tool "
                                              "(benchmarks/agent_tools.py); reported as the step's tool_seconds. "
                                              "[0, 0]: no delay.")

    @field_validator("step_delay_s")
    @classmethod
    def _delay(cls, value: tuple[float, float]) -> tuple[float, float]:
        lo, hi = value
        if not 0.0 <= lo <= hi:
            raise ValueError(f"needs 0 <= lo <= hi, got [{lo}, {hi}]")
        return value

    @field_validator("end", "lower", "higher", "error_text")
    @classmethod
    def _not_a_digit(cls, value: str) -> str:
        if not value or any(c.isdigit() for c in value):
            raise ValueError(f"{value!r} must be non-empty and contain no digit")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> GuessEnvConfig:
        marks = [self.end, self.lower, self.higher, self.error_text]
        if len(set(marks)) != len(marks):
            raise ValueError(f"end, lower, higher and error_text must differ; got {marks}")
        return self


class GuessEnvironment(Environment):
    """One guessing episode (see the module docstring)."""

    def __init__(self, config: GuessEnvConfig) -> None:
        self.config = config
        self._features = EnvironmentFeatures(owns_reward=True, deterministic=True, blocking=False, restore="replay")
        self.secret: int | None = None
        self.guesses: list[int] = []
        self._delays = random.Random()

    @property
    def features(self) -> EnvironmentFeatures:
        return self._features

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        return (_GUESS_TOOL.spec,) if self.config.format is CallFormat.HERMES else ()

    async def reset(self, record: Mapping[str, Any], *, seed: int) -> Observation:
        raw = str(record_field(record, self.config.answer_key)).strip()
        if not re.fullmatch(r"-?[0-9]+", raw):
            raise ValueError(f"the secret {self.config.answer_key!r} must be an integer, got {raw[:20]!r}")
        self.secret = int(raw)
        self.guesses = []
        self._delays.seed(seed)  # the delays of an episode are a function of its seed (they never change answers)
        text, messages = record_prompt(record)
        if self.config.format is CallFormat.COMPACT:
            return Observation(text=text)
        if messages:
            return Observation(messages=messages)
        try:
            span = f" between {int(record_field(record, 'low'))} and {int(record_field(record, 'high'))}"
        except (KeyError, TypeError, ValueError):
            span = ""
        return Observation(messages=[{"role": "user", "content": (
            f"I am thinking of an integer{span}. Find it: call the guess tool with a number, and it answers "
            "lower, higher or correct.")}])

    def _read(self, action: Action) -> tuple[int | None, str]:
        """The guessed integer, or None and why the turn is malformed."""
        if self.config.format is CallFormat.HERMES:
            parsed = parse_hermes(action.text, {"guess": _GUESS_TOOL})
            if not parsed.calls:
                return None, "no guess tool call in the turn"
            call = parsed.calls[0]
            if call.error is not None:
                return None, call.error
            try:
                return int(_GUESS_TOOL.validate(call.arguments)["number"]), ""
            except ValueError as exc:
                return None, str(exc)
        end = self.config.end
        if not action.text.endswith(end):
            return None, f"the turn does not end with {end!r}" + (
                " (it hit its token limit)" if action.finish_reason == "length" else "")
        body = action.text[: -len(end)]
        if not _CANONICAL.fullmatch(body):
            return None, f"{body[:20]!r} is not a number in canonical form"
        return int(body), ""

    async def step(self, action: Action) -> Step:
        if self.secret is None:
            raise RuntimeError("step before reset")
        start = time.perf_counter()
        lo, hi = self.config.step_delay_s
        if hi > 0:
            await asyncio.sleep(self._delays.uniform(lo, hi))
        step = self._answer(action)  # the game's answer, as one tool call: its seconds are the tool's
        return dataclasses.replace(step, info={**step.info, "tool_seconds": time.perf_counter() - start})

    def _answer(self, action: Action) -> Step:
        cfg = self.config
        guess, reason = self._read(action)
        if guess is None:
            shown = cfg.error_text if cfg.format is CallFormat.COMPACT else f"error: {reason}"
            return Step(self._say(shown), reward=0.0, done=False,
                        info={"tool_calls": 1, "tool_ok": False, "correct": 0.0, "reason": reason})
        self.guesses.append(guess)
        if guess == self.secret:
            return Step(None, reward=cfg.discount ** action.turn, done=True,
                        info={"tool_calls": 1, "tool_ok": True, "correct": 1.0, "guesses": len(self.guesses)})
        if cfg.format is CallFormat.COMPACT:
            shown = cfg.lower if self.secret < guess else cfg.higher
        else:
            shown = "lower" if self.secret < guess else "higher"
        return Step(self._say(shown), reward=0.0, done=False, info={"tool_calls": 1, "tool_ok": True, "correct": 0.0})

    def _say(self, text: str) -> Observation:
        if self.config.format is CallFormat.COMPACT:
            return Observation(text=text)
        return Observation(messages=[{"role": "tool", "name": "guess", "content": text}])


def solve(secret: int, low: int, high: int, *, end: str = ".") -> list[str]:
    """The turns of a binary search for ``secret`` in ``low..high`` (guessing the lower middle each time).

    For tests and the example's scripted check: at most ``ceil(log2(high - low + 2))`` turns.
    """
    if not low <= secret <= high:
        raise ValueError(f"{secret} is not in {low}..{high}")
    turns = []
    while True:
        mid = (low + high) // 2
        turns.append(f"{mid}{end}")
        if mid == secret:
            return turns
        low, high = (low, mid - 1) if secret < mid else (mid + 1, high)


# -- the dataset ----------------------------------------------------------------------------------------


class GuessDataConfig(BaseModel):
    """Options of the ``guess`` dataset."""

    model_config = ConfigDict(extra="forbid")

    low: int = Field(0, ge=0, description="Smallest secret.")
    high: int = Field(9, ge=0, description="Largest secret.")
    size: int = Field(100000, ge=1, description="Number of records.")
    seed: int = Field(0, description="Record i is a function of (seed, i) only.")
    template: str = Field("=", description="The prompt; it may name the range with '{low}' and '{high}' (never "
                          "the secret).")
    end: str = Field(".", description="The character that ends every guess; the dataset's stop_text.")

    @field_validator("end")
    @classmethod
    def _end(cls, value: str) -> str:
        if len(value) != 1 or value.isdigit() or value.isspace():
            raise ValueError(f"must be one character that is not a digit or a space, got {value!r}")
        return value

    @model_validator(mode="after")
    def _checks(self) -> GuessDataConfig:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is larger than high ({self.high})")
        names = {n for _, n, _, _ in string.Formatter().parse(self.template) if n is not None}
        if not names <= {"low", "high"}:
            raise ValueError(f"template may only use '{{low}}' and '{{high}}', not {sorted(names - {'low', 'high'})}")
        if not self.template.format(low=self.low, high=self.high):
            raise ValueError("template renders to an empty prompt")
        return self


class GuessDataset(Dataset):
    """Secrets for the guess environment; record i depends only on (seed, i).

    ``metadata``: ``answer`` (the secret, a canonical integer string),
    ``terminator`` (so the single-turn ``arithmetic`` reward scores one guess
    of the same records: the baseline), ``low`` and ``high``.
    """

    def __init__(self, config: GuessDataConfig) -> None:
        self.config = config
        self.stop_text: str = config.end

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> PromptRecord:
        cfg = self.config
        if not 0 <= index < cfg.size:
            raise IndexError(f"record {index} out of range for {cfg.size} records")
        key = f"asyncflow-guess/{cfg.seed}/{index}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")
        secret = cfg.low + draw % (cfg.high - cfg.low + 1)
        return PromptRecord(index=index, prompt=cfg.template.format(low=cfg.low, high=cfg.high),
                            metadata={"answer": str(secret), "terminator": cfg.end, "low": cfg.low,
                                      "high": cfg.high})
