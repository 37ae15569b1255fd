"""Built-in rewards: ``exact_match`` and ``math_verify`` (the completion's answer against ``metadata['answer']``).

``exact_match`` compares strings (after an optional ``\\boxed{}`` extraction).
``math_verify`` first finds the final answer (``\\boxed{}``, GSM8K's ``####``,
"The answer is ...") in the completion and in the reference, normalises the
usual notational noise (``$``, ``\\text{}``, ``\\frac``, thousands separators,
units, trailing ``.0``) and compares numbers exactly as fractions, anything
else as normalised text. It is a rule-based checker, not a computer algebra
system: ``x+1`` and ``1+x`` are different answers to it.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces import Reward
from asyncflow_core.plugins import RewardBackend, hookimpl
from asyncflow_core.types import RewardInput


class ExactMatchConfig(BaseModel):
    """Options of ``exact_match``."""

    model_config = ConfigDict(extra="forbid")

    answer_key: str = Field("answer", description="Metadata key holding the reference answer.")
    extract_boxed: bool = Field(True, description="Compare the last \\boxed{...} content when the completion has one.")
    strip: bool = Field(True, description="Ignore surrounding whitespace.")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


class ExactMatch(Reward):
    """1.0 when the (extracted) answer equals the reference exactly, else 0.0.

    A sample without the reference answer in its metadata raises
    ``KeyError`` — the runtime records that sample as failed.
    """

    #: synchronous, a string comparison a sample, no I/O: scored inline in the rollout's write (``reward.inline``)
    local = True

    def __init__(self, config: ExactMatchConfig) -> None:
        self.config = config

    def score(self, sample: RewardInput) -> float:
        reference = str(sample.metadata[self.config.answer_key])
        answer = sample.completion
        if self.config.extract_boxed:
            boxed = last_boxed(answer)
            answer = boxed if boxed is not None else answer
        if self.config.strip:
            answer, reference = answer.strip(), reference.strip()
            answer = re.sub(r"\s+", " ", answer)
        return float(answer == reference)


# ------------------------------------------------------------------------------------ math_verify


class MathVerifyConfig(BaseModel):
    """Options of ``math_verify``."""

    model_config = ConfigDict(extra="forbid")

    answer_key: str = Field("answer", description="Metadata key holding the reference answer (or a full solution).")
    extract_from_reference: bool = Field(
        True,
        description="Also extract the reference's final answer (its \\boxed{} or text after '####') before comparing.",
    )
    fallback: Literal["whole", "last_number", "none"] = Field(
        "whole",
        description=(
            "What to compare when the completion marks no final answer: 'whole' the whole completion, "
            "'last_number' its last number, 'none' nothing (scores 0)."
        ),
    )


_BOX_MACROS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:|=)\s*", re.IGNORECASE)
_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_FRACTION_RE = re.compile(rf"(-?)\(?({_NUMBER})\)?/\(?({_NUMBER})\)?")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_WORD_UNIT = re.compile(r"(-?[\d,]*\.?\d+)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\.?")
_TEXT_MACROS = ("\\text", "\\textbf", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox")
_UNIT = re.compile(r"^(.*\d)\s*\\(?:text|textrm|mathrm|mbox)\{\s*[A-Za-z][A-Za-z .]*\}$")


def _brace_group(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == '{'`` and the index after it; None if unbalanced."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : j], j + 1
    return None


def _last_box(text: str) -> str | None:
    """Argument of the last ``\\boxed``/``\\fbox`` (``\\boxed{...}`` with nesting, or ``\\boxed 5``)."""
    start, name = max((text.rfind(m), m) for m in _BOX_MACROS)
    if start < 0:
        return None
    i = start + len(name)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        group = _brace_group(text, i)
        return group[0] if group else None
    token = re.match(r"[^\s$]+", text[i:])
    return token.group(0) if token else None


def extract_answer(text: str) -> str | None:
    """The final answer a solution marks, or None: the last ``\\boxed{}``, else the text after the last
    ``####`` (GSM8K), else what follows the last "answer is" / "answer:" up to the end of its sentence."""
    boxed = _last_box(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text[text.rfind("####") + 4 :].strip()
        return tail.splitlines()[0] if tail else None
    found = list(_ANSWER_IS.finditer(text))
    if found:
        tail = text[found[-1].end() :].strip()
        tail = tail.splitlines()[0] if tail else ""
        tail = re.split(r"\.\s", tail, maxsplit=1)[0]  # "The answer is 42. Hope it helps."
        return tail or None
    return None


def _unwrap(text: str, macro: str, replace: str = "{}") -> str:
    """Replace every ``macro{arg}`` by ``replace.format(arg)`` (innermost arguments handled too)."""
    out, i = [], 0
    while True:
        j = text.find(macro + "{", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        group = _brace_group(text, j + len(macro))
        if group is None:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        out.append(replace.format(_unwrap(group[0], macro, replace)))
        i = group[1]


def _fracs(text: str) -> str:
    """``\\frac{a}{b}`` -> ``a/b`` (parenthesised unless a and b are plain numbers or symbols)."""
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)  # \frac12
    text = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", text)  # \frac{1}2
    while True:
        j = text.find("\\frac{")
        if j < 0:
            return text
        num = _brace_group(text, j + 5)
        if num is None or num[1] >= len(text) or text[num[1]] != "{":
            return text
        den = _brace_group(text, num[1])
        if den is None:
            return text
        a, b = (_fracs(x) for x in (num[0], den[0]))
        a, b = (x if re.fullmatch(r"-?[\w.]+", x) else f"({x})" for x in (a, b))
        text = f"{text[:j]}{a}/{b}{text[den[1]:]}"


def normalize_answer(text: str) -> str:
    """A canonical string for an answer: no math delimiters, spacing, units, ``\\text``, ``$``, ``%``, ``\\circ``;
    ``\\frac{a}{b}`` as ``a/b``; no thousands separators; no trailing period."""
    s = text.strip().replace("\u2212", "-")
    s = re.sub(r"^\*\*(.*)\*\*$", r"\1", s)  # markdown bold
    for token in ("\\(", "\\)", "\\[", "\\]", "\\$", "$", "\\!", "\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(token, " ")
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("{,}", ",")
    unit = _UNIT.match(s.strip())
    if unit:  # "5 \text{ cm}" -> "5"
        s = unit.group(1)
    for macro in _TEXT_MACROS:
        s = _unwrap(s, macro)
    words = _WORD_UNIT.fullmatch(s.strip())
    if words:  # "18 dollars" -> "18"
        s = words.group(1)
    for degree in ("^{\\circ}", "^\\circ", "\u00b0", "\\%", "%"):
        s = s.replace(degree, "")
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)
    s = _fracs(s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[A-Za-z]=(?=.)", "", s)  # "x=5" -> "5"
    if _GROUPED.fullmatch(s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)
    return choice.group(1) if choice else s


def to_number(text: str) -> Fraction | None:
    """The exact value of a normalised answer that is a decimal or a fraction of decimals, else None."""
    if re.fullmatch(_NUMBER, text):
        return Fraction(text)
    frac = _FRACTION_RE.fullmatch(text)
    if frac:
        sign, a, b = frac.groups()
        if Fraction(b) != 0:
            return (-1 if sign else 1) * Fraction(a) / Fraction(b)
    return None


def math_equal(answer: str, reference: str) -> bool:
    """Whether two final answers agree: as exact numbers when both are numbers, else as normalised text."""
    a, b = normalize_answer(answer), normalize_answer(reference)
    if not a or not b:
        return False
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b or (a.isalpha() and b.isalpha() and a.lower() == b.lower())


class MathVerify(Reward):
    """1.0 when the completion's final answer equals the reference's, else 0.0; tolerant of notation.

    Returns ``reward`` and ``answer_found`` (1 when the completion marked a
    final answer with ``\\boxed{}``, ``####`` or "the answer is", so the
    format rate can be logged apart from accuracy). A sample without the
    reference in its metadata raises ``KeyError`` (the runtime records it failed).
    """

    extras = ("answer_found",)

    def __init__(self, config: MathVerifyConfig) -> None:
        self.config = config

    def score(self, sample: RewardInput) -> dict[str, float]:
        cfg = self.config
        reference = str(sample.metadata[cfg.answer_key])
        if cfg.extract_from_reference:
            reference = extract_answer(reference) or reference
        answer = extract_answer(sample.completion)
        found = answer is not None
        if answer is None:
            if cfg.fallback == "whole":
                answer = sample.completion
            elif cfg.fallback == "last_number":
                numbers = _LAST_NUMBER.findall(sample.completion)
                answer = numbers[-1] if numbers else None
        correct = answer is not None and math_equal(answer, reference)
        return {"reward": float(correct), "answer_found": float(found)}


@hookimpl
def asyncflow_rewards():
    yield RewardBackend(
        name="exact_match",
        factory=ExactMatch,
        config_model=ExactMatchConfig,
        description="1 if the completion (or its last \\boxed{}) equals metadata['answer'], else 0.",
    )
    yield RewardBackend(
        name="math_verify",
        factory=MathVerify,
        config_model=MathVerifyConfig,
        description="1 if the completion's final answer (\\boxed{}, '####', 'answer is') equals metadata['answer'].",
    )
