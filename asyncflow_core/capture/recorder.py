"""Recording a black-box agent's chat calls as a token-in/token-out :class:`Trajectory`.

One :class:`CaptureSession` is one episode. Each call to the endpoint carries
the whole conversation (the OpenAI chat API is stateless); the session keeps
the tokens it has already fed the engine and the replies it returned, and
turns the new call into tokens without re-encoding anything the model said:

- **first call** (or a conversation that matches nothing recorded): the
  messages are rendered once by the chat template (``tools=`` passed through,
  with the generation prompt) and encoded: the episode's prompt;
- **a continuation**: the request's messages start with a recorded
  conversation, up to and including a reply this session returned (compared
  as messages: role, text, tool-call names and arguments; tool-call ids and
  ``None``/``""`` content are not told apart), followed only by new
  non-assistant messages. The earlier turns are the engine's own tokens, kept
  as they are. The new part is the template's text after the reply's
  end-of-turn marker, rendered once (the conversation with the generation
  prompt, minus the conversation up to the reply) and encoded, appended as an
  *observed* segment (loss mask 0). When the reply stopped on the end-of-turn
  token itself, that token stays sampled and only what follows it (``"\\n"``
  for ChatML) is observed; a reply cut by ``max_tokens`` gets the whole
  closing marker as observed tokens.

**Branches.** When the agent edits or rewinds its history, nothing is
re-tokenized silently:

- a call that resends an *earlier* point of a recorded conversation (a
  retry, a rewind) forks a new branch that shares the recorded tokens up to
  that reply;
- a call whose history matches no recorded reply (an edited message, a
  changed tool list, an assistant message this session did not generate, or
  a chat template that renders the history differently once more messages
  follow) starts a new branch from a fresh rendering: every earlier message,
  assistant ones included, becomes prompt (loss mask 0).

Each branch records why it began. :meth:`CaptureSession.trajectory` is the
branch of the most recent call (the one the agent finished on);
:meth:`CaptureSession.trajectories` gives every branch, for a rollout stage
that wants to train the abandoned ones too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow_core.capture.toolcalls import parse_tool_calls
from asyncflow_core.errors import AsyncflowError, ConfigError
from asyncflow_core.types.episode import Segment, Trajectory
from asyncflow_core.types.generation import FinishReason, GenerationResult, SamplingParams

log = logging.getLogger(__name__)

#: what the endpoint calls to generate: the rollout stage routes it through its replicas
SampleFn = Callable[[list[int], SamplingParams], Awaitable[GenerationResult]]

ROLES = ("system", "developer", "user", "assistant", "tool")
_PROBE_USER, _PROBE_REPLY = "capture-probe-user", "capture-probe-reply"


class CaptureError(AsyncflowError):
    """A request the endpoint refuses: an HTTP status and one line in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, *, status: int = 400, code: str | None = None) -> CaptureError:
    return CaptureError(status, message, param=param, code=code)


# ----------------------------------------------------------------------------------------- the chat template


class ChatRenderer:
    """A Hugging Face tokenizer's chat template, rendered to text and encoded once.

    ``tokenizer`` is a Hugging Face tokenizer or the runtime's ``HFTokenizer``
    (its ``.hf``). ``closing`` is the text the template puts after an
    assistant message's content (``"<|im_end|>\\n"`` for ChatML), found by
    rendering a probe conversation.
    """

    def __init__(self, tokenizer: Any) -> None:
        hf = getattr(tokenizer, "hf", tokenizer)
        if not callable(getattr(hf, "apply_chat_template", None)) or not getattr(hf, "chat_template", None):
            raise ConfigError("the capture endpoint needs a Hugging Face tokenizer with a chat template; use a chat "
                              "(instruct) checkpoint's tokenizer, or set tokenizer.chat_template")
        self.hf = hf
        limit = getattr(tokenizer, "max_prompt_tokens", None)
        self.max_prompt_tokens: int | None = limit if isinstance(limit, int) else None
        try:
            probe = self.text([{"role": "user", "content": _PROBE_USER},
                               {"role": "assistant", "content": _PROBE_REPLY}], None, generation_prompt=False)
        except CaptureError as exc:
            raise ConfigError(f"the tokenizer's chat template cannot render a user and an assistant message: "
                              f"{exc.message}") from None
        if _PROBE_REPLY not in probe:
            raise ConfigError("the tokenizer's chat template does not render an assistant message's content as is; "
                              "the capture endpoint cannot find where a reply ends")
        self.closing: str = probe[probe.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]

    def text(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None, *, generation_prompt: bool) -> str:
        try:
            out = self.hf.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                              add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja's TemplateError, raise_exception(...) in the template, a missing key
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise bad(f"the model's chat template refused these messages: {line}", "messages") from None
        if not isinstance(out, str):
            raise bad("the model's chat template did not render to text", "messages")
        return out

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.hf.encode(text, add_special_tokens=False)]

    def token_text(self, token: int) -> str:
        return self.hf.decode([int(token)], skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(t) for t in ids], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------- messages


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad(f"{where}.content[{k}] is a {kind!r} part; the capture endpoint takes text only", where)
        return "".join(parts)
    raise bad(f"{where}.content must be text or a list of text parts, got {type(content).__name__}", where)


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args  # kept as the agent wrote it; compared as text
    return args


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as the template sees them and the session compares them, or a 400."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for j, msg in enumerate(messages):
        where = f"messages[{j}]"
        if not isinstance(msg, Mapping):
            raise bad(f"{where} must be an object with 'role' and 'content', got {type(msg).__name__}", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad(f"{where} has the role {role!r}; use one of {', '.join(ROLES)}", where)
        norm: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": _text_content(msg.get("content"), where)}
        calls = msg.get("tool_calls") if role == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list", where)
            norm["tool_calls"] = []
            for k, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{k}] needs a function with a name", where)
                norm["tool_calls"].append({"type": "function", "function": {
                    "name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))}})
        if role == "tool" and isinstance(msg.get("tool_call_id"), str):
            norm["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            norm["name"] = msg["name"]
        out.append(norm)
    return out


# ----------------------------------------------------------------------------------------- the session


@dataclass
class ChatCall:
    """One validated ``/chat/completions`` request."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    sampling: SamplingParams
    logprobs: bool = False
    parse_tools: bool = False  #: turn ``<tool_call>`` blocks into ``tool_calls`` (the request declared tools)
    overridden: bool = False  #: the agent asked for sampling settings the run does not honour
    clamped: bool = False  #: the agent's max_tokens was above the run's


@dataclass
class TextCall:
    """One validated ``/completions`` request: a prompt as text or as token ids."""

    prompt_text: str | None
    prompt_ids: list[int] | None
    sampling: SamplingParams
    logprobs: bool = False
    overridden: bool = False
    clamped: bool = False


@dataclass(frozen=True)
class Answer:
    """A served call: the OpenAI response body, and the sampled tokens it was made from (for streaming)."""

    body: dict[str, Any]
    tokens: list[int]  #: what the engine sampled, as recorded (the stop token included)
    logprobs: list[float]
    stop_id: int | None  #: the stop token the reply ended on (its text is not in the reply), None: it did not


@dataclass(frozen=True)
class _Reply:
    at: int  #: index of the reply in the branch's conversation
    n_segments: int  #: segments up to and including its sampled segment
    stop_id: int | None  #: the stop token it ended on (kept as a sampled token), None: cut by max_tokens


@dataclass
class _Branch:
    index: int
    reason: str
    tools: list[Any] | None
    prompt_ids: tuple[int, ...]
    kind: str = "chat"  #: "chat": matched by messages; "text": /completions calls, matched by prompt text or ids
    texts: list[str | None] = field(default_factory=list)  #: text branches: the prompt text + reply, per reply
    segments: list[Segment] = field(default_factory=list)
    conversation: list[dict[str, Any]] = field(default_factory=list)
    replies: list[_Reply] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    tool_calls: int = 0

    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *(t for s in self.segments for t in s.token_ids)]


def _ints(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def _floats(x: Any) -> list[float]:
    return [float(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


class CaptureSession:
    """One episode of one agent: its calls, recorded into branches of tokens.

    Point the agent at :attr:`base_url` with :attr:`api_key`. Calls on one
    session are served one at a time (in arrival order); calls on different
    sessions run concurrently.
    """

    def __init__(self, session_id: str, base_url: str, api_key: str, *, renderer: ChatRenderer, sample: SampleFn,
                 model: str, metadata: Mapping[str, Any] | None = None) -> None:
        self.id, self.base_url, self.api_key = session_id, base_url, api_key
        self.metadata = dict(metadata or {})
        self.reward: float | None = None
        self.closed = False
        self._renderer, self._sample, self._model = renderer, sample, model
        self._branches: list[_Branch] = []
        self._current: _Branch | None = None
        self._lock = asyncio.Lock()
        self._calls = 0
        self._errors: list[str] = []
        self._parse_errors = 0
        self._overridden = 0
        self._clamped = 0

    # -- matching a call to what was recorded

    def _match(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> tuple[_Branch, int, int] | None:
        """The recorded reply the call continues: (branch, its turn, messages up to it), the longest match."""
        best: tuple[_Branch, int, int] | None = None
        for branch in reversed(self._branches):
            if branch.kind != "chat" or branch.tools != tools:
                continue
            for turn in range(len(branch.replies) - 1, -1, -1):
                end = branch.replies[turn].at + 1
                if (len(messages) >= end and messages[:end] == branch.conversation[:end]
                        and all(m["role"] != "assistant" for m in messages[end:])):
                    if best is None or end > best[2]:
                        best = (branch, turn, end)
                    break
        return best

    def _why_new(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        last = self._current
        if last is None:
            return "first call"
        if last.kind != "chat":
            return "the earlier calls were /completions, not chat"
        if last.tools != tools:
            return "the request's tools differ from the recorded ones"
        for j, (got, recorded) in enumerate(zip(messages, last.conversation)):
            if got != recorded:
                return f"messages[{j}] ({got['role']}) differs from the recorded conversation"
        if len(messages) < len(last.conversation):
            return "the conversation is shorter than the recorded one and ends with no recorded reply"
        return "the new messages hold an assistant message this session did not generate"

    def _plan(self, call: ChatCall) -> tuple[_Branch, list[int], int | None]:
        """The branch this call extends (new or forked ones not yet registered), the observed tokens, their turn."""
        r = self._renderer
        found = self._match(call.messages, call.tools)
        reason = None
        if found is not None:
            branch, turn, end = found
            before = r.text(call.messages[:end], call.tools, generation_prompt=False)
            after = r.text(call.messages, call.tools, generation_prompt=True)
            if after.startswith(before) and before.endswith(r.closing):
                reply = branch.replies[turn]
                stop_text = r.token_text(reply.stop_id) if reply.stop_id is not None else ""
                glue = r.closing[len(stop_text):] if stop_text and r.closing.startswith(stop_text) else r.closing
                observed = r.encode(glue + after[len(before):])
                if turn < len(branch.replies) - 1:  # an earlier point of the branch: fork it there
                    branch = _Branch(
                        index=len(self._branches), tools=call.tools, prompt_ids=branch.prompt_ids,
                        reason=f"forked from branch {branch.index} after turn {turn}: the agent resent an "
                               f"earlier point of the conversation",
                        segments=list(branch.segments[:reply.n_segments]),
                        conversation=list(branch.conversation[:end]), replies=list(branch.replies[:turn + 1]),
                        finish_reasons=list(branch.finish_reasons[:turn + 1]))
                return branch, observed, turn
            reason = "the chat template renders the recorded history differently once new messages follow"
        prompt = r.encode(r.text(call.messages, call.tools, generation_prompt=True))
        if not prompt:
            raise bad("the messages render to no tokens", "messages")
        return _Branch(index=len(self._branches), reason=reason or self._why_new(call.messages, call.tools),
                       tools=call.tools, prompt_ids=tuple(prompt)), [], None

    # -- a call

    async def _serve(self, call: ChatCall | TextCall, serve: Any) -> Answer:
        """One call at a time per session: refuse a closed session, count the call, record its error."""
        async with self._lock:
            if self.closed:
                raise CaptureError(410, f"session {self.id!r} is closed (its episode was already collected)",
                                   code="session_closed")
            self._calls += 1
            self._overridden += call.overridden
            self._clamped += call.clamped
            try:
                return await serve(call)
            except CaptureError as exc:
                self._errors.append(exc.message)
                raise

    async def chat(self, call: ChatCall) -> dict[str, Any]:
        """Serve one chat call: sample after the recorded tokens, record, and answer in OpenAI's shape."""
        return (await self.chat_answer(call)).body

    async def chat_answer(self, call: ChatCall) -> Answer:
        """:meth:`chat`, with the sampled tokens the body was made from (what a streamed answer is cut into)."""
        return await self._serve(call, self._chat)

    async def _chat(self, call: ChatCall) -> Answer:
        branch, observed, observed_turn = self._plan(call)
        prompt, result, stop_id, text = await self._sample_after(branch, observed, call.sampling)
        content: str | None = text
        tool_calls: list[dict[str, Any]] = []
        if call.parse_tools:
            parsed = parse_tool_calls(text)
            content, tool_calls = parsed.content, parsed.calls
            self._parse_errors += parsed.errors
        finish = "tool_calls" if tool_calls else ("stop" if result.finish_reason is FinishReason.STOP else "length")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        tokens, logprobs = self._record(branch, observed, observed_turn, result, stop_id, finish,
                                        at=len(call.messages))
        branch.conversation = [*call.messages, *normalize_messages([message])]
        branch.tool_calls += len(tool_calls)

        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if call.logprobs:
            texts = [self._renderer.token_text(t) for t in tokens]
            choice["logprobs"] = {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                for s, lp in zip(texts, logprobs)]}
        return Answer(self._response("chatcmpl", "chat.completion", choice, prompt, tokens), tokens, logprobs,
                      stop_id)

    async def complete(self, call: TextCall) -> dict[str, Any]:
        """Serve one ``/completions`` call (a raw prompt, no chat template) the same way."""
        return (await self.complete_answer(call)).body

    async def complete_answer(self, call: TextCall) -> Answer:
        """:meth:`complete`, with the sampled tokens the body was made from."""
        return await self._serve(call, self._complete)

    def _plan_text(self, call: TextCall) -> tuple[_Branch, list[int], int | None]:
        """Token prompts match any branch's tokens at a reply; text prompts match a text branch's text."""
        best: tuple[_Branch, int, int] | None = None  # (branch, turn, matched length)
        for branch in reversed(self._branches):
            for turn in range(len(branch.replies) - 1, -1, -1):
                if call.prompt_ids is not None:
                    n = branch.replies[turn].n_segments
                    done = [*branch.prompt_ids, *(t for seg in branch.segments[:n] for t in seg.token_ids)]
                    hit = call.prompt_ids[:len(done)] == done
                    size = len(done)
                else:
                    done_text = branch.texts[turn] if branch.kind == "text" else None
                    hit = done_text is not None and call.prompt_text.startswith(done_text)
                    size = len(done_text or "")
                if hit:
                    if best is None or size > best[2]:
                        best = (branch, turn, size)
                    break
        if best is None:
            prompt = list(call.prompt_ids) if call.prompt_ids is not None else [
                int(t) for t in self._renderer.hf.encode(call.prompt_text)]
            if not prompt:
                raise bad("the prompt encodes to no tokens", "prompt")
            reason = "first call" if self._current is None else "the prompt continues no recorded reply"
            return _Branch(index=len(self._branches), reason=reason, tools=None, prompt_ids=tuple(prompt),
                           kind="text"), [], None
        branch, turn, size = best
        observed = (list(call.prompt_ids[size:]) if call.prompt_ids is not None
                    else self._renderer.encode(call.prompt_text[size:]))
        if turn < len(branch.replies) - 1:
            reply = branch.replies[turn]
            branch = _Branch(
                index=len(self._branches), tools=branch.tools, prompt_ids=branch.prompt_ids, kind=branch.kind,
                reason=f"forked from branch {branch.index} after turn {turn}: the agent resent an earlier point "
                       f"of the conversation",
                segments=list(branch.segments[:reply.n_segments]), conversation=[],
                replies=list(branch.replies[:turn + 1]), finish_reasons=list(branch.finish_reasons[:turn + 1]),
                texts=list(branch.texts[:turn + 1]))
        return branch, observed, turn

    async def _complete(self, call: TextCall) -> Answer:
        branch, observed, observed_turn = self._plan_text(call)
        prompt, result, stop_id, text = await self._sample_after(branch, observed, call.sampling)
        finish = "stop" if result.finish_reason is FinishReason.STOP else "length"
        tokens, logprobs = self._record(branch, observed, observed_turn, result, stop_id, finish, at=-1)
        if branch.kind == "chat":
            branch.kind, branch.conversation = "text", []  # a chat branch continued by token ids: no messages now
            branch.texts = [None] * (len(branch.replies) - 1)
        branch.texts.append(call.prompt_text + text if call.prompt_text is not None else None)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if call.logprobs:
            texts = [self._renderer.token_text(t) for t in tokens]
            offsets = [0]
            for piece in texts[:-1]:
                offsets.append(offsets[-1] + len(piece))
            choice["logprobs"] = {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None,
                                  "text_offset": offsets}
        return Answer(self._response("cmpl", "text_completion", choice, prompt, tokens), tokens, logprobs, stop_id)

    async def _sample_after(self, branch: _Branch, observed: list[int], sampling: SamplingParams):
        """Sample after the branch's tokens and ``observed``: (prompt, result, the stop id it ended on, its text)."""
        prompt = [*branch.tokens(), *observed]
        limit = self._renderer.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise bad(f"the conversation is {len(prompt)} tokens, but the model's context leaves room for "
                      f"{limit}; shorten it or start a new session", "messages", code="context_length_exceeded")
        result = await self._generate(prompt, sampling)
        tokens = _ints(result.token_ids)
        stops = set(sampling.stop_token_ids)
        stop_id = tokens[-1] if result.finish_reason is FinishReason.STOP and tokens and tokens[-1] in stops else None
        text = self._renderer.decode(tokens[:-1] if stop_id is not None else tokens)
        return prompt, result, stop_id, text

    def _record(self, branch: _Branch, observed: list[int], observed_turn: int | None, result: GenerationResult,
                stop_id: int | None, finish: str, *, at: int) -> tuple[list[int], list[float]]:
        """Commit a successful call to its branch (nothing of a failed call is recorded)."""
        tokens, logprobs, versions = _ints(result.token_ids), _floats(result.logprobs), _ints(result.versions)
        if branch.index == len(self._branches):
            self._branches.append(branch)
        if observed:
            branch.segments.append(Segment(tuple(observed), sampled=False, turn=observed_turn or 0))
        branch.segments.append(Segment(tuple(tokens), sampled=True, logprobs=tuple(logprobs),
                                       versions=tuple(versions), turn=len(branch.replies)))
        branch.replies.append(_Reply(at=at, n_segments=len(branch.segments), stop_id=stop_id))
        branch.finish_reasons.append(finish)
        self._current = branch
        return tokens, logprobs

    def _response(self, prefix: str, obj: str, choice: dict[str, Any], prompt: list[int],
                  tokens: list[int]) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": self._model, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
        }

    async def _generate(self, prompt: list[int], sampling: SamplingParams) -> GenerationResult:
        try:
            result = await self._sample(prompt, sampling)
        except (asyncio.CancelledError, CaptureError):  # a refusal of the sample function is the agent's answer
            raise
        except AsyncflowError as exc:
            raise CaptureError(500, f"the engine failed: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                               type="server_error") from None
        except Exception as exc:  # the engine's bug: logged with its traceback here, one line to the agent
            log.exception("capture: the sample function raised")
            raise CaptureError(500, f"the engine failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}", type="server_error") from None
        if result.finish_reason is FinishReason.ERROR:
            raise CaptureError(500, f"the engine failed: {result.error or 'no reason given'}", type="server_error")
        if result.finish_reason is FinishReason.ABORT:
            raise CaptureError(503, "the engine aborted the completion (the sample function must resume or retry "
                               "aborted requests itself)", type="server_error")
        return result

    def post_reward(self, reward: Any) -> None:
        if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
            raise bad(f"'reward' must be a number, got {reward!r}", "reward")
        if self.closed:
            raise CaptureError(410, f"session {self.id!r} is closed (its episode was already collected)",
                               code="session_closed")
        self.reward = float(reward)

    # -- the episode

    def _trajectory(self, branch: _Branch) -> Trajectory:
        sampled = sum(len(s.token_ids) for s in branch.segments if s.sampled)
        observed = sum(len(s.token_ids) for s in branch.segments if not s.sampled)
        info = {
            "session": self.id, "calls": self._calls, "turns": len(branch.replies),
            "branch": branch.index, "branches": len(self._branches), "branch_reason": branch.reason,
            "branch_reasons": [b.reason for b in self._branches],
            "prompt_tokens": len(branch.prompt_ids), "sampled_tokens": sampled, "observed_tokens": observed,
            "finish_reasons": list(branch.finish_reasons), "tool_calls": branch.tool_calls,
            "tool_call_parse_errors": self._parse_errors, "errors": list(self._errors),
            "sampling_overridden": self._overridden, "max_tokens_clamped": self._clamped,
            "metadata": dict(self.metadata),
        }
        return Trajectory(prompt_ids=branch.prompt_ids, segments=list(branch.segments), reward=self.reward,
                          status="ok", info=info)

    def trajectory(self) -> Trajectory:
        """The episode so far: the branch of the most recent successful call."""
        if self._current is None:
            return Trajectory(prompt_ids=(), reward=self.reward, status="failed: the agent made no successful call",
                              info={"session": self.id, "calls": self._calls, "branches": 0,
                                    "errors": list(self._errors), "metadata": dict(self.metadata)})
        return self._trajectory(self._current)

    def trajectories(self) -> list[Trajectory]:
        """Every branch, in the order they began (``info['branch']`` is the index)."""
        return [self._trajectory(b) for b in self._branches]

    async def close(self) -> Trajectory:
        """End the episode (after any call in flight), refuse later calls, and return :meth:`trajectory`."""
        async with self._lock:
            self.closed = True
        return self.trajectory()


__all__ = ["Answer", "CaptureError", "CaptureSession", "ChatCall", "ChatRenderer", "SampleFn", "TextCall",
           "normalize_messages"]
