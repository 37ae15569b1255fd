"""Turning prompts into token ids and completions back into text for rewards.

With ``model.path`` set, the checkpoint's Hugging Face tokenizer is used
(``transformers`` needed). Without one (the toy and simulated models), a
character tokenizer over ``model.alphabet``: token ``i`` is ``alphabet[i]``;
a character outside the alphabet is an error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

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
