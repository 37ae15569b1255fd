"""A synthetic arithmetic task family: dataset ``arithmetic`` and reward ``arithmetic``.

Prompts such as ``"12+34="`` are generated, never downloaded: record ``i``
comes from a random generator seeded with ``(seed, i)`` alone, so every
process and every run sees the same record at the same index without
materialising the dataset. The expected completion is the integer result
followed by a terminator character (``"46."``); the reward reads the
completion up to the first terminator and compares it, as an integer in
canonical form, with ``metadata["answer"]``.

Every character the task uses (digits, the chosen operators, ``-`` for
negative results, the template's literal text and the terminator) is listed by
:func:`task_alphabet`; with the defaults they all lie in the default
``model.alphabet`` of the character tokenizer.
"""

from __future__ import annotations

import hashlib
import re
import string

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import Dataset, Reward
from asyncflow_core.plugins import DatasetBackend, RewardBackend, hookimpl
from asyncflow_core.types import PromptRecord, RewardInput
from asyncflow_plugins.datasets import template_fields

SUPPORTED_OPERATORS = "+-*"
DEFAULT_TERMINATOR = "."
_DIGITS = "0123456789"


class ArithmeticConfig(BaseModel):
    """Options of the ``arithmetic`` dataset."""

    model_config = ConfigDict(extra="forbid")

    operators: str = Field("+-", description="Operators to draw from, a non-empty subset of '+-*' (e.g. '+', '+-*').")
    min_digits: int = Field(1, ge=1, le=18, description="Fewest digits of an operand.")
    max_digits: int = Field(2, ge=1, le=18, description="Most digits of an operand (never with leading zeros).")
    operands: int = Field(2, ge=2, le=16, description="Operands per expression; '*' binds tighter than '+' and '-'.")
    size: int = Field(1000, ge=1, description="Number of records.")
    seed: int = Field(0, description="Record i is a function of (seed, i) only: change the seed for another set.")
    template: str = Field(
        "{expression}=",
        description="Prompt format; '{expression}' is replaced by e.g. '12+34'. Use '{{' and '}}' for literal braces.",
    )
    terminator: str = Field(
        DEFAULT_TERMINATOR,
        description="Character that ends the answer; stored in each record's metadata for the reward.",
    )

    @field_validator("operators")
    @classmethod
    def _operators(cls, value: str) -> str:
        bad = sorted(set(value) - set(SUPPORTED_OPERATORS))
        if not value or bad:
            what = bad or "none given"
            raise ValueError(f"must be a non-empty subset of {SUPPORTED_OPERATORS!r}; unsupported: {what}")
        return "".join(dict.fromkeys(value))  # keep order, drop repeats

    @field_validator("terminator")
    @classmethod
    def _terminator(cls, value: str) -> str:
        if len(value) != 1:
            raise ValueError(f"must be exactly one character, got {value!r}")
        if value in _DIGITS + SUPPORTED_OPERATORS or value.isspace():
            raise ValueError(f"{value!r} can be part of an answer; pick a character such as '.'")
        return value

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        fields = template_fields(value)
        if fields != {"expression"}:
            extra = sorted(fields - {"expression"})
            raise ValueError(
                "must contain the placeholder '{expression}' and no other"
                + (f" (found {', '.join('{' + f + '}' for f in extra)})" if extra else "")
            )
        return value

    @model_validator(mode="after")
    def _digit_range(self) -> ArithmeticConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) is larger than max_digits ({self.max_digits})")
        return self


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of ``a0 op0 a1 op1 ...`` with the usual precedence ('*' before '+' and '-', left to right)."""
    terms = [operands[0]]
    signs = [1]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def task_alphabet(config: ArithmeticConfig | None = None) -> str:
    """The fewest characters the task needs (prompts and expected completions), for a small ``model.alphabet``.

    Digits first, then operators, ``-`` (results can be negative when ``-`` is
    drawn), ``=`` and the rest of the template, then the terminator.
    """
    config = config or ArithmeticConfig()
    literal = "".join(text for text, *_ in string.Formatter().parse(config.template))
    negative = "-" if "-" in config.operators else ""
    return "".join(dict.fromkeys(_DIGITS + config.operators + negative + literal + config.terminator))


def check_alphabet(config: ArithmeticConfig, alphabet: str) -> None:
    """``ConfigError`` naming the characters the task needs that ``alphabet`` lacks."""
    missing = [c for c in task_alphabet(config) if c not in alphabet]
    if missing:
        raise ConfigError(
            f"the arithmetic task uses {''.join(missing)!r}, which model.alphabet {alphabet!r} lacks; "
            "add them or change the operators/template/terminator"
        )


class _Draws:
    """Integers drawn from a hash of (seed, index, draw number).

    Not :mod:`random`: its integer methods may change between Python versions,
    and a record must stay the same on every machine and version (resume and
    evaluation sets depend on it). 128 hash bits make the modulo bias negligible.
    """

    def __init__(self, seed: int, index: int) -> None:
        self._key = f"asyncflow-arithmetic/{seed}/{index}/".encode()
        self._count = 0

    def between(self, low: int, high: int) -> int:
        """A draw from ``low..high`` inclusive."""
        digest = hashlib.blake2b(self._key + str(self._count).encode(), digest_size=16).digest()
        self._count += 1
        return low + int.from_bytes(digest, "little") % (high - low + 1)


class ArithmeticDataset(Dataset):
    """Generated arithmetic problems; record ``i`` depends only on ``(seed, i)``.

    ``metadata`` holds ``answer`` (the result as a canonical integer string),
    ``terminator`` and ``expression``. Records are built on access and cached
    nowhere, so ``size`` can be large.

    ``stop_text`` (the terminator) tells the runtime what ends a completion:
    with the character tokenizer it becomes every request's stop token and
    the built model's EOS, unless ``model.eos`` names it already.
    """

    def __init__(self, config: ArithmeticConfig) -> None:
        self.config = config
        self.stop_text: str = config.terminator

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> PromptRecord:
        cfg = self.config
        if not 0 <= index < cfg.size:
            raise IndexError(f"record {index} out of range for {cfg.size} records")
        draw = _Draws(cfg.seed, index)
        operands = []
        for _ in range(cfg.operands):
            digits = draw.between(cfg.min_digits, cfg.max_digits)
            low = 0 if digits == 1 else 10 ** (digits - 1)
            operands.append(draw.between(low, 10**digits - 1))
        operators = [cfg.operators[draw.between(0, len(cfg.operators) - 1)] for _ in range(cfg.operands - 1)]
        expression = str(operands[0]) + "".join(op + str(v) for op, v in zip(operators, operands[1:]))
        answer = str(evaluate(operands, operators))
        return PromptRecord(
            index=index,
            prompt=cfg.template.format(expression=expression),
            metadata={"answer": answer, "terminator": cfg.terminator, "expression": expression},
        )


class ArithmeticRewardConfig(BaseModel):
    """Options of the ``arithmetic`` reward."""

    model_config = ConfigDict(extra="forbid")

    answer_key: str = Field("answer", description="Metadata key holding the expected integer.")
    terminator: str | None = Field(
        None,
        description="Character ending the answer; null: the record's metadata['terminator'], else '.'.",
    )
    require_terminator: bool = Field(
        True, description="A completion without the terminator scores 0; false: the whole completion is the answer."
    )
    allow_leading_zeros: bool = Field(
        False, description="Accept '007' for 7 (and '-0' for 0); by default only the canonical form is correct."
    )
    partial_credit: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "Shaping, not accuracy: a well-formed wrong answer earns this weight times the fraction of its "
            "digits that match the expected ones (aligned from the last digit). 0 disables it."
        ),
    )

    @field_validator("terminator")
    @classmethod
    def _one_char(cls, value: str | None) -> str | None:
        if value is not None and len(value) != 1:
            raise ValueError(f"must be exactly one character, got {value!r}")
        return value


_CANONICAL = re.compile(r"0|-?[1-9][0-9]*")
_ANY_INT = re.compile(r"-?[0-9]+")


def digit_agreement(predicted: str, expected: str) -> float:
    """Fraction of positions, aligned from the right, where two integer strings agree (sign counts as a position)."""
    width = max(len(predicted), len(expected))
    a, b = predicted.rjust(width), expected.rjust(width)
    return sum(x == y for x, y in zip(a, b)) / width


class ArithmeticReward(Reward):
    """1.0 when the completion, up to its first terminator, is the expected integer; else 0.0.

    Returns a mapping: ``reward`` (what training uses), ``correct`` (1/0,
    accuracy independent of shaping) and ``formatted`` (1 when the completion
    was an integer followed by the terminator). A sample without the expected
    answer in its metadata raises ``KeyError`` (the runtime records it failed).
    """

    extras = ("correct", "formatted")
    #: synchronous, microseconds a sample, no I/O: scored inline in the rollout's write (``reward.inline``)
    local = True

    def __init__(self, config: ArithmeticRewardConfig) -> None:
        self.config = config

    def score(self, sample: RewardInput) -> dict[str, float]:
        cfg = self.config
        expected = str(sample.metadata[cfg.answer_key]).strip()
        terminator = cfg.terminator or str(sample.metadata.get("terminator", DEFAULT_TERMINATOR))
        text = sample.completion
        cut = text.find(terminator)
        if cut < 0 and cfg.require_terminator:
            return {"reward": 0.0, "correct": 0.0, "formatted": 0.0}
        answer = (text if cut < 0 else text[:cut]).strip()
        pattern = _ANY_INT if cfg.allow_leading_zeros else _CANONICAL
        if not pattern.fullmatch(answer):
            return {"reward": 0.0, "correct": 0.0, "formatted": 0.0}
        correct = int(answer) == int(expected)
        reward = 1.0 if correct else cfg.partial_credit * digit_agreement(answer, expected)
        return {"reward": float(reward), "correct": float(correct), "formatted": 1.0}


@hookimpl
def asyncflow_datasets():
    yield DatasetBackend(
        name="arithmetic",
        factory=ArithmeticDataset,
        config_model=ArithmeticConfig,
        description="Generated integer arithmetic prompts ('12+34='), deterministic in (seed, index).",
    )


@hookimpl
def asyncflow_rewards():
    yield RewardBackend(
        name="arithmetic",
        factory=ArithmeticReward,
        config_model=ArithmeticRewardConfig,
        description="1 if the completion up to the terminator is the expected integer; reports 'correct' apart.",
    )

