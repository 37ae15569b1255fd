"""``ToolEnvironment``: turns tool calls in the model's output into calls of its tools.

Each policy turn is parsed in the environment's call format
(:mod:`asyncflow_plugins.envs.tools`). A turn with calls runs them (in
order, at most ``max_calls_per_turn``) and answers with their results: one
``tool`` message per call for a chat model, or text for the character
tokenizer. A turn without a call is the final answer: the episode is done and
:meth:`ToolEnvironment.score` gives its reward (0 by default: a ``reward``
plugin scores the final text unless the environment owns the reward).

A malformed call (bad JSON, unknown tool, wrong arguments) or a tool that
raises is answered with what was wrong, and recorded in the step's ``info``
(``tool_ok`` false, ``reason``); it never ends the episode by itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow_core.interfaces.environment import (
    Action,
    Environment,
    EnvironmentFeatures,
    Observation,
    Step,
    ToolSpec,
)
from asyncflow_plugins.envs.tools import CallFormat, ParsedTurn, Tool, ToolCall, ToolResult, parse_calls


def record_prompt(record: Any) -> tuple[str, list[dict[str, Any]] | None]:
    """``(prompt text, chat messages or None)`` of a dataset row (a mapping or a ``PromptRecord``)."""
    if not isinstance(record, Mapping):
        record = {"prompt": getattr(record, "prompt", ""), "metadata": getattr(record, "metadata", {})}
    metadata = record.get("metadata") or {}
    messages = record.get("messages", metadata.get("messages"))
    return str(record.get("prompt", "")), ([dict(m) for m in messages] if messages else None)


def record_field(record: Any, key: str) -> Any:
    """``record[key]``, else ``record["metadata"][key]``; ``KeyError`` naming the key otherwise."""
    if not isinstance(record, Mapping):
        record = {"metadata": getattr(record, "metadata", {}), **{k: getattr(record, k) for k in ("prompt", "index")
                                                                   if hasattr(record, k)}}
    if key in record:
        return record[key]
    metadata = record.get("metadata") or {}
    if key in metadata:
        return metadata[key]
    raise KeyError(f"the dataset row has no {key!r} (fields: {sorted(record)}, metadata: {sorted(metadata)})")


class ToolEnvironment(Environment):
    """A generic tool-calling episode: calls are run and answered until the model answers without one.

    Subclasses change the prompt (:meth:`prompt`), the answer's reward
    (:meth:`score`) or how a turn is read (:meth:`parse`).
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        call_format: CallFormat | str = CallFormat.HERMES,
        features: EnvironmentFeatures | None = None,
        max_calls_per_turn: int = 4,
        end_text: str = "",
        result_template: str = "{result}",
        error_template: str = "error: {reason}",
        text_observations: bool | None = None,
    ) -> None:
        self._tools = {t.name: t for t in tools}
        if len(self._tools) != len(tools):
            raise ValueError("two tools share a name")
        self.call_format = CallFormat(call_format)
        self._features = features or EnvironmentFeatures()
        self.max_calls_per_turn = max_calls_per_turn
        self.end_text = end_text  #: stripped from a compact turn before parsing (the stop character)
        self.result_template = result_template
        self.error_template = error_template
        #: observations as text (character tokenizer) or as chat messages; default: text for compact calls
        self.text_observations = (self.call_format is CallFormat.COMPACT) if text_observations is None \
            else text_observations
        self.record: Any = None
        self.calls_made = 0

    @property
    def features(self) -> EnvironmentFeatures:
        return self._features

    @property
    def tools(self) -> Sequence[ToolSpec]:
        return tuple(t.spec for t in self._tools.values())

    # -- what subclasses change --------------------------------------------------------------------------

    def prompt(self, record: Any) -> Observation:
        """The first observation: the row's chat messages, or its prompt as a user message or as text."""
        text, messages = record_prompt(record)
        if self.text_observations:
            return Observation(text=text)
        return Observation(messages=messages or [{"role": "user", "content": text}])

    def parse(self, action: Action) -> ParsedTurn:
        """The calls in a turn (and the rest of its text)."""
        return parse_calls(action.text, self._tools, self.call_format, end=self.end_text)

    def score(self, answer: str, action: Action) -> tuple[float, dict[str, Any]]:
        """Reward and info of the final answer; default 0 (a reward plugin scores the episode)."""
        return 0.0, {}

    def call_reward(self, call: ToolCall, result: ToolResult) -> float:
        """Per-call shaping reward (default 0)."""
        return 0.0

    # -- the contract ---------------------------------------------------------------------------------

    async def reset(self, record: Mapping[str, Any], *, seed: int) -> Observation:
        self.record = record
        self.calls_made = 0
        return self.prompt(record)

    async def step(self, action: Action) -> Step:
        parsed = self.parse(action)
        if not parsed.calls:
            reward, info = self.score(parsed.text, action)
            return Step(None, reward=reward, done=True,
                        info={"tool_calls": 0, "answered": True, **info})
        results: list[tuple[ToolCall, ToolResult]] = []
        calls = parsed.calls[: self.max_calls_per_turn]
        for call in calls:
            if call.error is not None:
                results.append((call, ToolResult(call.name or "?", False, call.error)))
                continue
            assert call.name is not None
            results.append((call, await self._tools[call.name].invoke(call.arguments)))
        errors = [r.content for _, r in results if not r.ok]
        if len(parsed.calls) > self.max_calls_per_turn:
            errors.append(f"{len(parsed.calls)} calls in one turn; at most {self.max_calls_per_turn} are run")
        self.calls_made += len(calls)
        reward = sum(self.call_reward(c, r) for c, r in results)
        info: dict[str, Any] = {
            "tool_calls": len(calls),
            "tool_names": [r.name for _, r in results],
            "tool_ok": not errors,
            "tool_seconds": sum(r.seconds for _, r in results),
        }
        if errors:
            info["reason"] = errors[0]
        return Step(self.observe(results), reward=reward, done=False, info=info)

    def observe(self, results: Sequence[tuple[ToolCall, ToolResult]]) -> Observation:
        """The results as ``tool`` messages, or as text through the result/error templates."""
        texts = [self.result_template.format(result=r.content) if r.ok
                 else self.error_template.format(reason=r.content) for _, r in results]
        if self.text_observations:
            return Observation(text="".join(texts))
        return Observation(messages=[{"role": "tool", "name": r.name, "content": t}
                                     for (_, r), t in zip(results, texts)])


def load_tool(path: str) -> Tool:
    """A :class:`Tool` from ``"package.module:name"`` (a ``@tool`` function, or a typed function to wrap)."""
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tool {path!r} must look like package.module:function")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tool {path!r} cannot be imported: {exc}") from None
    return target if isinstance(target, Tool) else Tool(target)

