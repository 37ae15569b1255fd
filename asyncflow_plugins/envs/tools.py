"""Tools: typed, documented callables, and the formats a model uses to call them.

A tool is a plain function decorated with :func:`tool`. Its JSON schema comes
from the type hints, its description from the docstring's first paragraph and
each argument's description from the docstring's ``Args:`` section::

    @tool
    def calc(expression: str) -> str:
        \"\"\"Evaluate one integer operation such as 12*34.

        Args:
            expression: two integers and one of + - *.
        \"\"\"

:meth:`Tool.invoke` validates a parsed call against the signature and runs
the function (sync or async). Two call formats are parsed from a turn's text:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  what Qwen2.5's chat template teaches (one block per call);
- ``compact``: ``name(arg1,arg2)``, the whole turn (a trailing end character
  is ignored), for tiny models with a character tokenizer: arguments are
  positional, separated by top-level commas, and converted to the declared
  types. An environment may also give a *default tool* that a bare turn calls
  with its whole text (see :mod:`asyncflow_plugins.envs.calculator`).

A malformed call never raises: it comes back as a :class:`ToolCall` whose
``error`` says what was wrong, which the environment shows the model and
records (``tool_ok`` false, ``reason``).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, ValidationError, create_model

from asyncflow_core.interfaces.environment import ToolSpec

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema(annotation: Any, where: str) -> dict[str, Any]:
    """JSON schema of one type hint (str, int, float, bool, Literal, enums, list[X], dict[str, X], X | None)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": [m.value for m in annotation]}
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        item = args[0] if args else Any
        return {"type": "array"} if item is Any else {"type": "array", "items": _schema(item, where)}
    if origin in (dict, Mapping) or annotation is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return {**_schema(inner[0], where), "nullable": True} if len(args) == 2 else _schema(inner[0], where)
        return {"anyOf": [_schema(a, where) for a in inner]}
    if annotation is Any:
        return {}
    raise TypeError(f"{where}: type {annotation!r} has no JSON schema; use str, int, float, bool, Literal, "
                    "an Enum, list[...] or dict[str, ...]")


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}[A-Za-z_][A-Za-z0-9_]*)\s*(\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {arg: description})`` from a Google-style docstring (first paragraph; ``Args:`` block)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    i = 0
    while i < len(lines) and lines[i].strip() and not _ARGS_HEADER.match(lines[i]):
        description.append(lines[i].strip())
        i += 1
    current: str | None = None
    indent: int | None = None
    in_args = False
    for line in lines[i:]:
        if _ARGS_HEADER.match(line):
            in_args, current, indent = True, None, None
            continue
        if not in_args:
            continue
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # another section (Returns:, Raises:) ends the block
            in_args = False
            continue
        match = _ARG_LINE.match(line)
        if match and (indent is None or depth <= indent):
            indent = depth
            current = match.group(1).lstrip("*")
            args[current] = match.group(3).strip()
        elif current is not None:  # a continuation line
            args[current] = (args[current] + " " + line.strip()).strip()
    return " ".join(description), args


@dataclass(frozen=True)
class ToolResult:
    """What running one call gave: ``ok`` and the text shown to the model (the result, or what was wrong)."""

    name: str
    ok: bool
    content: str  #: the result as text (``str`` kept, other values as JSON); on failure the reason
    seconds: float = 0.0


class Tool:
    """A function with its :class:`ToolSpec`; call it as usual, or :meth:`invoke` it from a parsed call."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        doc_description, arg_docs = parse_docstring(fn.__doc__)
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
        properties: dict[str, Any] = {}
        required: list[str] = []
        fields: dict[str, Any] = {}
        self.parameters: list[str] = []
        for pname, param in signature.parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name!r}: *args/**kwargs cannot be described to a model; name each argument")
            if pname not in hints:
                raise TypeError(f"tool {self.name!r}: argument {pname!r} needs a type hint (it becomes the JSON schema)")
            prop = _schema(hints[pname], f"tool {self.name!r} argument {pname!r}")
            if pname in arg_docs:
                prop["description"] = arg_docs[pname]
            properties[pname] = prop
            self.parameters.append(pname)
            if param.default is param.empty:
                required.append(pname)
                fields[pname] = (hints[pname], ...)
            else:
                fields[pname] = (hints[pname], param.default)
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            schema["required"] = required
        self.spec = ToolSpec(name=self.name, description=description or doc_description or self.name,
                             parameters=schema)
        self._model = create_model(f"{self.name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        self._is_async = inspect.iscoroutinefunction(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments checked and converted to the declared types; ``ValueError`` with one line otherwise."""
        try:
            model = self._model.model_validate(dict(arguments))
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "arguments"
                msg = "unknown argument" if err["type"] == "extra_forbidden" else err["msg"]
                problems.append(f"{loc}: {msg}")
            raise ValueError(f"bad arguments for {self.name}: {'; '.join(problems)}") from None
        return {k: getattr(model, k) for k in self.parameters}

    async def invoke(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Validate and run; a bad argument or an exception of the tool becomes ``ok=False`` with the reason."""
        start = time.perf_counter()
        try:
            kwargs = self.validate(arguments)
        except ValueError as exc:
            return ToolResult(self.name, False, str(exc), time.perf_counter() - start)
        try:
            value = await self.fn(**kwargs) if self._is_async else self.fn(**kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool's failure is shown to the model, not raised
            message = str(exc).splitlines()[0] if str(exc) else ""
            return ToolResult(self.name, False, f"{self.name} failed: {type(exc).__name__}: {message}".rstrip(": "),
                              time.perf_counter() - start)
        content = value if isinstance(value, str) else json.dumps(value)
        return ToolResult(self.name, True, content, time.perf_counter() - start)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Any:
    """Make a :class:`Tool` of a typed, documented function: ``@tool`` or ``@tool(name=..., description=...)``."""
    if fn is None:
        return lambda f: Tool(f, name=name, description=description)
    return Tool(fn, name=name, description=description)


# -- call formats ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call found in a turn: ``name`` and ``arguments``, or ``error`` saying why it could not be read."""

    name: str | None
    arguments: Mapping[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    """A turn's text split into its tool calls and the rest (the answer, when there are no calls)."""

    calls: tuple[ToolCall, ...]
    text: str  #: the turn without its call blocks


class CallFormat(str, enum.Enum):
    HERMES = "hermes"  #: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Hermes)
    COMPACT = "compact"  #: name(arg1,arg2), for tiny models with a character tokenizer


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, tools: Mapping[str, Tool]) -> ParsedTurn:
    """Every ``<tool_call>...</tool_call>`` block of ``text``; an unclosed block is a malformed call."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0
    while True:
        start = text.find(_HERMES_OPEN, pos)
        if start < 0:
            rest.append(text[pos:])
            break
        rest.append(text[pos:start])
        end = text.find(_HERMES_CLOSE, start)
        if end < 0:
            raw = text[start:]
            calls.append(ToolCall(None, raw=raw, error=f"{_HERMES_OPEN} is not closed by {_HERMES_CLOSE}"))
            break
        raw = text[start + len(_HERMES_OPEN):end]
        calls.append(_hermes_call(raw.strip(), tools))
        pos = end + len(_HERMES_CLOSE)
    return ParsedTurn(tuple(calls), "".join(rest).strip())


def _hermes_call(raw: str, tools: Mapping[str, Tool]) -> ToolCall:
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall(None, raw=raw, error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(None, raw=raw, error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = payload["name"]
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name, raw=raw, error=f"the arguments of {name} are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(name, raw=raw, error=f"the arguments of {name} must be a JSON object")
    if name not in tools:
        return ToolCall(name, arguments, raw, error=_unknown(name, tools))
    return ToolCall(name, arguments, raw)


def _unknown(name: str, tools: Mapping[str, Tool]) -> str:
    return f"unknown tool {name!r}; available: {', '.join(sorted(tools)) or 'none'}"


_COMPACT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.DOTALL)


def _split_args(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``"1,(2,3),'a,b'"`` -> ``["1", "(2,3)", "'a,b'"]``."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts] if text.strip() else []


def parse_compact(text: str, tools: Mapping[str, Tool], *, end: str = "",
                  default_tool: str | None = None) -> ParsedTurn:
    """The turn as one ``name(args)`` call (``end``, e.g. the stop character, stripped first).

    Without that shape the turn is an answer (no calls) unless ``default_tool``
    is given, in which case the whole turn is its single argument.
    """
    body = text[: -len(end)] if end and text.endswith(end) else text
    match = _COMPACT.match(body)
    if match is None or (match.group(1) not in tools and default_tool is not None):
        if default_tool is None:
            return ParsedTurn((), body.strip())
        target = tools[default_tool]
        if not target.parameters:
            return ParsedTurn((ToolCall(default_tool, {}, body),), "")
        return ParsedTurn((ToolCall(default_tool, {target.parameters[0]: body.strip()}, body),), "")
    name, inner = match.group(1), match.group(2)
    if name not in tools:
        return ParsedTurn((ToolCall(name, raw=body, error=_unknown(name, tools)),), "")
    target = tools[name]
    values = [v[1:-1] if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"" else v for v in _split_args(inner)]
    if len(values) > len(target.parameters):
        return ParsedTurn((ToolCall(name, raw=body, error=f"{name} takes {len(target.parameters)} argument(s), "
                                                            f"got {len(values)}"),), "")
    return ParsedTurn((ToolCall(name, dict(zip(target.parameters, values)), body),), "")


def parse_calls(text: str, tools: Mapping[str, Tool], call_format: CallFormat | str, *, end: str = "",
                default_tool: str | None = None) -> ParsedTurn:
    """Parse a turn in ``call_format`` (see :class:`CallFormat`)."""
    if CallFormat(call_format) is CallFormat.HERMES:
        return parse_hermes(text, tools)
    return parse_compact(text, tools, end=end, default_tool=default_tool)


def render_hermes_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The text of one call in the hermes format (what a model trained on Qwen2.5's template writes)."""
    return f"{_HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{_HERMES_CLOSE}"
