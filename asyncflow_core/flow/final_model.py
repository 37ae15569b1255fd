"""Make ``final_model/`` a complete checkpoint: the weights the train engine exported, plus what a loader needs.

A train engine's ``export_pretrained`` writes the weights and ``config.json``
(and may copy some tokenizer files). :func:`complete_final_model` adds, from
the run's ``model.path`` checkpoint, every tokenizer file (vocabulary, merges,
special tokens, ``tokenizer_config.json`` with its chat template, a
``chat_template.jinja``) and ``generation_config.json`` (its EOS ids end chat
completions), so ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load the directory and the chat template
renders the prompts the run trained on. A run without ``model.path`` (the
character tokenizer) has no tokenizer files to carry; nothing is added.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

#: files of a Hugging Face checkpoint that describe its tokenizer, chat template and generation defaults
CARRIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def complete_final_model(model: Any, path: Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config of ``model.path`` into ``path``; the names copied.

    The source's files replace any the engine wrote (a ``generation_config.json``
    rebuilt from the model config lacks the chat EOS ids the checkpoint lists).
    """
    source = getattr(model, "path", None)
    if not source or not path.is_dir():
        return []
    copied = []
    for name in CARRIED_FILES:
        src = Path(source) / name
        if src.is_file():
            shutil.copy2(src, path / name)
            copied.append(name)
    return copied
