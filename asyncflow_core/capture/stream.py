"""``stream=true``: a served answer cut into OpenAI's Server-Sent Events chunks.

The engine API returns a finished completion (``RolloutEngine.generate``
yields whole results), so a streamed call is sampled and recorded exactly as
a non-streamed one, and only then sent as chunks: what the episode records
does not depend on ``stream``. The agent gets the reply in one burst, in the
shape the OpenAI SDK assembles:

- chat: a first chunk with ``delta.role``; then one chunk per sampled token
  (``delta.content`` its text, ``logprobs.content`` its log-prob when asked),
  the stop token's chunk with empty content; a reply with parsed
  ``tool_calls`` gets its text and every log-prob in one chunk, then one chunk
  per tool call (``delta.tool_calls``, arguments whole); a last chunk with an
  empty delta and the ``finish_reason``;
- completions: one chunk per sampled token (``text``, ``logprobs`` sliced per
  token), the last one with the ``finish_reason``;
- ``stream_options.include_usage``: every chunk has ``"usage": null`` and a
  last chunk with no choices carries the usage;
- then ``data: [DONE]``.

The per-token texts are decoded incrementally (a token that ends inside a
multi-byte character gives "" and the character comes with the next one);
joined they are exactly the non-streamed text, and when a tokenizer's decoding
is not incremental (it rewrites earlier text), the text comes whole in the
last token's chunk instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from asyncflow_core.capture.recorder import Answer

DONE = b"data: [DONE]\n\n"


def event(chunk: dict[str, Any]) -> bytes:
    """One SSE event."""
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def token_texts(tokens: Sequence[int], decode: Callable[[Sequence[int]], str], whole: str) -> list[str]:
    """Each token's share of ``whole`` (= ``decode(tokens)``), decoded incrementally; joined they are ``whole``."""
    out: list[str] = []
    prefix = read = 0  # decode tokens[prefix:] and keep what is past tokens[prefix:read]'s text
    for k in range(len(tokens)):
        before = decode(tokens[prefix:read])
        after = decode(tokens[prefix:k + 1])
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            out.append(after[len(before):])
            prefix, read = read, k + 1
        else:
            out.append("")
    if "".join(out) != whole:  # not incremental for this tokenizer: all of it at the end
        out = [""] * (len(tokens) - 1) + [whole] if tokens else []
    return out


def _head(body: dict[str, Any], obj: str, usage: bool) -> dict[str, Any]:
    head = {"id": body["id"], "object": obj, "created": body["created"], "model": body["model"]}
    if usage:
        head["usage"] = None
    return head


def _usage(body: dict[str, Any], obj: str) -> dict[str, Any]:
    return {**_head(body, obj, False), "choices": [], "usage": body["usage"]}


def chat_chunks(answer: Answer, decode: Callable[[Sequence[int]], str], *, include_usage: bool = False
                ) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a served chat call."""
    body = answer.body
    obj = "chat.completion.chunk"
    [choice] = body["choices"]
    message, finish = choice["message"], choice["finish_reason"]
    entries = (choice.get("logprobs") or {}).get("content")  # None: logprobs were not asked for
    head = _head(body, obj, include_usage)

    def chunk(delta: dict[str, Any], logprobs: list[Any] | None = None, finish_reason: str | None = None):
        lp = {"content": logprobs, "refusal": None} if entries is not None and logprobs is not None else None
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}

    yield chunk({"role": "assistant", "content": ""})
    calls = message.get("tool_calls")
    if calls:  # the text outside the calls and every log-prob together, then each call whole
        content = message.get("content")
        yield chunk({"content": content} if content else {}, entries)
        for k, call in enumerate(calls):
            yield chunk({"tool_calls": [{"index": k, **call}]})
    else:
        text_tokens = answer.tokens[:-1] if answer.stop_id is not None else answer.tokens
        pieces = token_texts(text_tokens, decode, message.get("content") or "")
        if answer.stop_id is not None:
            pieces.append("")
        for k, piece in enumerate(pieces):
            yield chunk({"content": piece}, entries[k:k + 1] if entries is not None else None)
    yield chunk({}, finish_reason=finish)
    if include_usage:
        yield _usage(body, obj)


def completion_chunks(answer: Answer, decode: Callable[[Sequence[int]], str], *, include_usage: bool = False
                      ) -> Iterator[dict[str, Any]]:
    """The ``text_completion`` chunks of a served ``/completions`` call."""
    body = answer.body
    obj = "text_completion"
    [choice] = body["choices"]
    lps = choice.get("logprobs")
    head = _head(body, obj, include_usage)
    text_tokens = answer.tokens[:-1] if answer.stop_id is not None else answer.tokens
    pieces = token_texts(text_tokens, decode, choice["text"])
    if answer.stop_id is not None:
        pieces.append("")
    if not pieces:
        pieces = [""]  # nothing sampled: one chunk still carries the finish reason
    last = len(pieces) - 1
    for k, piece in enumerate(pieces):
        logprobs = None
        if lps is not None and k < len(lps["tokens"]):
            logprobs = {"tokens": lps["tokens"][k:k + 1], "token_logprobs": lps["token_logprobs"][k:k + 1],
                        "top_logprobs": None, "text_offset": lps["text_offset"][k:k + 1]}
        yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": logprobs,
                                    "finish_reason": choice["finish_reason"] if k == last else None}]}
    if include_usage:
        yield _usage(body, obj)


__all__ = ["DONE", "chat_chunks", "completion_chunks", "event", "token_texts"]
