"""Turning prompts into token ids and completions back into text for rewards.

With ``model.path``, the checkpoint's own Hugging Face tokenizer is used
(``transformers`` needed), read from disk exactly as a downloaded model's
would be; a directory without one is refused. Without a path (the toy and
simulated models), a character tokenizer over ``model.alphabet``: token ``i``
is ``alphabet[i]``; a character outside the alphabet is an error naming it.

A record whose metadata carries ``messages`` (role/content dicts: a chat) is
rendered once, by the checkpoint's chat template with the generation prompt,
``model.system_prompt`` first when the chat has no system message. Engines
only ever see the resulting token ids.

What ends a completion is decided here too, once per run, and put in every
rollout request's ``stop_token_ids`` (engines stop on exactly those, never on
a model EOS they were not asked to): the tokenizer's EOS and the EOS ids of
the checkpoint's ``generation_config.json`` with ``model.path``; ``model.eos``
(or the dataset's ``stop_text``) with the character tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from asyncflow_core.config.errors import format_validation_error
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError

#: roles a ``messages`` record may use
CHAT_ROLES = ("system", "user", "assistant", "tool")
#: files of which a checkpoint directory needs at least one to have a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    #: longest prompt the model (``model.hf_config``'s context) can still answer; None: unknown
    max_prompt_tokens: int | None = None

    def __init__(self, alphabet: str) -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ConfigError("model.alphabet must be a non-empty string of distinct characters")
        self.alphabet = alphabet
        self._index = {c: i for i, c in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as exc:
            raise ConfigError(
                f"prompt {text!r} has the character {exc.args[0]!r}, which is not in model.alphabet "
                f"{self.alphabet!r}; extend the alphabet or give the dataset prompt_token_ids"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        n = len(self.alphabet)
        return "".join(self.alphabet[i] if 0 <= i < n else "\ufffd" for i in (int(t) for t in ids))


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` as a list of role/content dicts, or a :class:`ConfigError` naming ``where`` and the problem."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, "
                          f"got {type(messages).__name__}")
    out = []
    for j, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise ConfigError(f"{where}: messages[{j}] must be an object with 'role' and 'content', got {msg!r}")
        if msg["role"] not in CHAT_ROLES:
            raise ConfigError(f"{where}: messages[{j}] has the unknown role {msg['role']!r}; "
                              f"use one of {', '.join(CHAT_ROLES)}")
        if not isinstance(msg["content"], str):
            raise ConfigError(f"{where}: messages[{j}].content is {type(msg['content']).__name__}, not text")
        out.append(dict(msg))
    return out


class HFTokenizer:
    """A checkpoint's Hugging Face tokenizer, with its chat template, EOS and context length."""

    def __init__(self, hf: Any, *, path: str, system_prompt: str | None = None,
                 max_positions: int | None = None) -> None:
        self.hf = hf
        self.path = path
        self.system_prompt = system_prompt
        #: longest prompt an engine can still generate after (None: unknown)
        self.max_prompt_tokens = max_positions - 1 if max_positions else None
        self.eos_token_id: int | None = hf.eos_token_id  # the flow never pads (rows are ragged): no pad id here

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        # the stop token (<|im_end|>) is part of a completion's ids; rewards read the text without it
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: Any, where: str) -> list[int]:
        """A chat's prompt ids: the chat template with the generation prompt, ``system_prompt`` first if none."""
        chat = check_messages(messages, where)
        if not getattr(self.hf, "chat_template", None):
            raise ConfigError(f"{where} has 'messages' but the tokenizer of model.path {self.path!r} has no chat "
                              "template; use a chat (instruct) checkpoint, set tokenizer.chat_template and save it, "
                              "or give the records a 'prompt' instead")
        if self.system_prompt is not None and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        ids = self.hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers versions that return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def _max_positions(cfg: Any) -> int | None:
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(positions) if positions else None


def make_tokenizer(model: Any) -> Tokenizer:
    if model.path:
        try:
            from transformers import AutoTokenizer  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError("model.path is set but transformers is not installed: pip install transformers") from exc
        path = Path(model.path)
        if not path.is_dir():
            raise ConfigError(f"model.path {model.path!r} is not a directory; give a local Hugging Face checkpoint")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(f"model.path {model.path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                              "save the model's tokenizer there with tokenizer.save_pretrained(path)")
        try:
            hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=model.trust_remote_code,
                                               local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"model.path {model.path!r}: its tokenizer does not load "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        from asyncflow_core.config.hf import hf_config

        return HFTokenizer(hf, path=str(path), system_prompt=getattr(model, "system_prompt", None),
                           max_positions=_max_positions(hf_config(model)))
    tok = CharTokenizer(model.alphabet)
    positions = (model.hf_config or {}).get("max_position_embeddings")
    tok.max_prompt_tokens = int(positions) - 1 if isinstance(positions, int) and positions > 0 else None
    return tok


def encode_record(tokenizer: Tokenizer, record: Any) -> tuple[int, ...]:
    """A dataset record's prompt ids: its own ``prompt_token_ids``, its rendered ``messages``, or its encoded prompt.

    A prompt the model has no room to answer (at least its context length in
    tokens) is a :class:`ConfigError`.
    """
    where = f"dataset record {record.index}"
    if record.prompt_token_ids:
        ids = tuple(int(t) for t in record.prompt_token_ids)
    elif "messages" in record.metadata:
        render = getattr(tokenizer, "render", None)
        if render is None:
            raise ConfigError(f"{where} has 'messages', which need a checkpoint's tokenizer and chat template; "
                              "set model.path, or give the records a 'prompt' instead")
        ids = tuple(render(record.metadata["messages"], where))
    else:
        try:
            ids = tuple(tokenizer.encode(record.prompt))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    limit = getattr(tokenizer, "max_prompt_tokens", None)
    if limit is not None and len(ids) > limit:
        raise ConfigError(f"{where}: the prompt is {len(ids)} tokens, but the model's context is {limit + 1} "
                          f"positions (max_position_embeddings), leaving no room to generate; shorten the prompt "
                          f"or use a model with a longer context")
    return ids


def with_dataset_end(model: ModelConfig, dataset: Any) -> ModelConfig:
    """``model`` with ``eos`` set to the dataset's ``stop_text`` (character tokenizer only).

    A dataset whose expected completions end with a marker (the arithmetic
    terminator ``"."``) declares it as ``stop_text``; unless ``model.eos``
    already names the same character, it becomes the run's end token. A
    different ``model.eos`` is a contradiction and refused.
    """
    stop = getattr(dataset, "stop_text", None)
    if model.path is not None or stop is None:
        return model
    if model.eos is not None:
        if model.eos != stop:
            raise ConfigError(f"model.eos {model.eos!r} differs from the dataset's end marker {stop!r}; "
                              f"set model.eos to {stop!r} (or change the dataset's terminator)")
        return model
    try:
        return ModelConfig.model_validate({**model.model_dump(), "eos": stop})
    except ValidationError as exc:
        raise ConfigError(f"the dataset's end marker {stop!r}: " + format_validation_error(exc)) from None


def stop_token_ids(model: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The token ids that end a completion: the requests' ``stop_token_ids`` for the whole run.

    Character tokenizer: ``model.eos`` (none: completions run to
    ``max_new_tokens``). A checkpoint: its tokenizer's EOS and the EOS ids of
    its ``generation_config.json`` (chat models list several).
    """
    if model.path is None:
        return (model.alphabet.index(model.eos),) if model.eos is not None else ()
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    try:
        from transformers import GenerationConfig  # type: ignore[import-not-found]

        generation = GenerationConfig.from_pretrained(model.path, local_files_only=True)
    except (ImportError, OSError, ValueError):
        generation = None  # no generation_config.json: the tokenizer's EOS is all there is
    more = getattr(generation, "eos_token_id", None)
    ids.extend([more] if isinstance(more, int) else list(more or []))
    if not ids:
        raise ConfigError(f"model.path {model.path!r} names no EOS token (neither its tokenizer nor its "
                          "generation_config.json), so no completion could end before rollout.max_new_tokens; "
                          "set eos_token_id in generation_config.json")
    return tuple(dict.fromkeys(int(t) for t in ids))
