"""Turning prompts into token ids and completions back into text for rewards.

With ``model.path`` set, the checkpoint's Hugging Face tokenizer is used
(``transformers`` needed). Without one (the toy and simulated models), a
character tokenizer over ``model.alphabet``: token ``i`` is ``alphabet[i]``;
a character outside the alphabet is an error naming it.

What ends a completion is decided here too, once per run, and put in every
rollout request's ``stop_token_ids`` (engines stop on exactly those, never on
a model EOS they were not asked to): the checkpoint's EOS ids with
``model.path``; ``model.eos`` (or the dataset's ``stop_text``) with the
character tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from asyncflow_core.config.errors import format_validation_error
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
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


def make_tokenizer(model: Any) -> Tokenizer:
    if model.path:
        try:
            from transformers import AutoTokenizer  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError("model.path is set but transformers is not installed: pip install transformers") from exc
        return AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return CharTokenizer(model.alphabet)


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
    return tuple(dict.fromkeys(int(t) for t in ids))
