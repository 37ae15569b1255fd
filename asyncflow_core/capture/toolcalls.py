"""Tool calls in the model's text, Hermes/Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The capture endpoint turns them into OpenAI ``tool_calls`` when the request
declared ``tools``. A block that is not a JSON object with a string ``name``
(or an unclosed block: the reply ran out of tokens) is left in the text and
counted as a parse error: the agent sees what the model wrote, and the
episode's ``info`` says how often the format was missed.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedCalls:
    content: str | None  #: the text outside the parsed blocks (None when nothing is left)
    calls: list[dict[str, Any]]  #: OpenAI ``tool_calls`` entries
    errors: int  #: blocks that looked like tool calls but did not parse


def _call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> ParsedCalls:
    """The tool calls in ``text`` and the text around them."""
    calls: list[dict[str, Any]] = []
    errors = 0
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1).strip())
        if call is None:
            errors += 1
            continue  # left in the text (below)
        calls.append(call)
        kept.append(text[pos:match.start()])
        pos = match.end()
    kept.append(text[pos:])
    rest = "".join(kept)
    if rest.rfind(OPEN) > rest.rfind(CLOSE):
        errors += 1  # an unclosed block at the end (the reply ran out of tokens)
    if not calls:
        return ParsedCalls(text, [], errors)
    rest = rest.strip()
    return ParsedCalls(rest or None, calls, errors)
