"""Observations into token ids, once: the only place an episode's text becomes tokens.

An episode's sequence is built by appending, never by re-encoding: the
policy's sampled tokens go in exactly as the engine returned them, and each
observation is rendered here once and appended after them.

- ``token_ids``: appended as they are.
- ``text``: encoded by the run's tokenizer (the character tokenizer, or a
  checkpoint's without special tokens after the first observation).
- ``messages`` (a checkpoint with a chat template): on reset, the template
  with the environment's tools and the generation prompt; on a step, the
  tokens the template puts *after the policy's end-of-turn token* for the new
  messages, with the generation prompt for the next turn.

How a step's tokens are found. The template is rendered twice over the
episode's first messages and a placeholder assistant turn: without the new
messages (no generation prompt), and with them (with the generation
prompt). The first rendering's last end-of-turn token (a stop token) closes
the placeholder turn; the two renderings agree up to it, and everything the
second has after it is the step's tokens. So what the template puts after
its end-of-turn token (ChatML's ``"\\n"`` after ``<|im_end|>``) is included
once, and the sampled turn itself is never rendered from text. A sampled
turn that did not end with a stop token (it hit its length limit) gets the
template's end-of-turn token first, as observed glue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces.environment import Observation, ToolSpec

#: the placeholder assistant content the step delta is computed around (plain letters: no template escapes it)
_PLACEHOLDER = "placeholder"


class RenderError(ValueError):
    """An observation could not be rendered (the reason is one line, meant for the user)."""


def _ids(out: Any) -> list[int]:
    if isinstance(out, Mapping):  # transformers versions that return a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


class Renderer:
    """Renders one run's observations. ``stop_ids`` are the run's stop tokens (what ends a sampled turn).

    ``tokenizer`` is the run's tokenizer: a :class:`~asyncflow_core.flow.tokenizer.CharTokenizer`, or an
    :class:`~asyncflow_core.flow.tokenizer.HFTokenizer` (its ``hf`` object renders chats).
    """

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.hf = getattr(tokenizer, "hf", None)
        self.system_prompt: str | None = getattr(tokenizer, "system_prompt", None)

    @property
    def has_template(self) -> bool:
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    # -- text ---------------------------------------------------------------------------------------

    def _encode(self, text: str, *, first: bool) -> list[int]:
        if self.hf is not None and not first:
            return [int(t) for t in self.hf.encode(text, add_special_tokens=False)]  # no BOS mid-episode
        try:
            return [int(t) for t in self.tokenizer.encode(text)]
        except ConfigError as exc:
            raise RenderError(str(exc)) from None

    # -- chat ---------------------------------------------------------------------------------------

    def _chat(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not self.has_template:
            raise RenderError("the environment returned chat messages, but the run's tokenizer has no chat template; "
                              "use a chat checkpoint (model.path) or have the environment return text")
        chat = [dict(m) for m in messages]
        for j, m in enumerate(chat):
            if "role" not in m:
                raise RenderError(f"observation message {j} has no 'role': {m!r}")
        return chat

    def _template(self, chat: list[dict[str, Any]], tools: Sequence[ToolSpec], *, generation_prompt: bool) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": generation_prompt, "tokenize": True}
        if tools:
            kwargs["tools"] = [t.as_openai() for t in tools]
        try:
            return _ids(self.hf.apply_chat_template(chat, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a template error (jinja raise_exception, bad roles) is the user's
            raise RenderError(f"the chat template failed on the environment's messages: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

    def _with_system(self, chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.system_prompt is not None and (not chat or chat[0].get("role") != "system"):
            return [{"role": "system", "content": self.system_prompt}, *chat]
        return chat

    # -- the two calls ------------------------------------------------------------------------------

    def reset(self, obs: Observation, tools: Sequence[ToolSpec] = ()) -> list[int]:
        """The prompt: the first observation's tokens (chat: the template with tools and the generation prompt)."""
        if obs.token_ids is not None:
            return [int(t) for t in obs.token_ids]
        if obs.text is not None:
            return self._encode(obs.text, first=True)
        assert obs.messages is not None
        return self._template(self._with_system(self._chat(obs.messages)), tools, generation_prompt=True)

    def step(self, obs: Observation, *, history: Sequence[Mapping[str, Any]] = (), tools: Sequence[ToolSpec] = (),
             ended_by_stop: bool = True) -> tuple[list[int], list[int]]:
        """``(glue, tokens)`` to append after a sampled turn: ``glue`` closes a turn that ended without a stop
        token (chat templates only), ``tokens`` are the observation's. ``history`` is the episode's first
        messages (its reset observation's), which the template sees before the placeholder turn."""
        if obs.token_ids is not None:
            return [], [int(t) for t in obs.token_ids]
        if obs.text is not None:
            return [], self._encode(obs.text, first=False)
        assert obs.messages is not None
        new = self._chat(obs.messages)
        base = self._with_system(self._chat(history)) if history else []
        closed = [*base, {"role": "assistant", "content": _PLACEHOLDER}]
        before = self._template(closed, tools, generation_prompt=False)
        after = self._template([*closed, *new], tools, generation_prompt=True)
        eot = self._end_of_turn(before)
        if after[:eot + 1] != before[:eot + 1]:
            raise RenderError("the chat template renders the conversation before the new messages differently "
                              "once they are added, so a step cannot be appended as tokens; use a template whose "
                              "earlier turns do not depend on later ones")
        glue = [] if ended_by_stop else [before[eot]]
        return glue, after[eot + 1:]

    def _end_of_turn(self, rendered: list[int]) -> int:
        """Index of the placeholder turn's end-of-turn token: the last stop token of ``rendered``."""
        for i in range(len(rendered) - 1, -1, -1):
            if rendered[i] in self.stop_ids:
                return i
        raise RenderError("the chat template does not end an assistant turn with any of the run's stop tokens "
                          f"{sorted(self.stop_ids)}, so the policy's turns could not end where the template's do; "
                          "list the template's end-of-turn token in generation_config.json's eos_token_id")
