"""Built-in datasets read from local files: ``jsonl``, ``parquet`` and ``hf_disk``.

All three share one set of options (:class:`FileDatasetConfig`): which field
is the prompt, an optional ``template`` that builds the prompt from several
fields, and an optional ``answer_key`` copied to ``metadata["answer"]`` (the
key rewards read by default). Every other field of a row is kept in the
record's metadata.

A row may hold a chat instead of a prompt: a ``messages`` field (a list of
``{role, content}``), kept as ``metadata["messages"]`` and rendered once by
the checkpoint's chat template when the run starts feeding it (see
``asyncflow_core.flow.tokenizer``). Its roles are checked when the file is
read; the record's ``prompt`` text (what rewards see) is its last user message.

Files are read once, when the dataset is built, so a missing file, a missing
field or a template that does not fit the data is a :class:`ConfigError` at
start-up that names the file, the row and the fields that do exist, never a
failure halfway through a run. ``pyarrow`` and ``datasets`` are imported only
by the backends that need them (``pip install 'asyncflow[data]'``).
"""

from __future__ import annotations

import importlib
import json
import re
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.tokenizer import check_messages
from asyncflow_core.interfaces import Dataset
from asyncflow_core.plugins import DatasetBackend, hookimpl
from asyncflow_core.types import PromptRecord

DATA_EXTRA_HINT = "pip install 'asyncflow[data]'"


def template_fields(template: str) -> set[str]:
    """Field names a ``str.format`` template refers to; ``ValueError`` for bad syntax or unnamed placeholders."""
    names: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"template {template!r} is not a valid format string ({exc}); write '{{{{' for a literal '{{'"
        ) from None
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ValueError(f"template {template!r} has a positional placeholder '{{{name}}}'; name a field instead")
        names.add(root)
    return names


class FileDatasetConfig(BaseModel):
    """Options shared by the file datasets."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Local file or directory to read.")
    prompt_key: str = Field("prompt", description="Field holding the prompt text; every row must have it.")
    template: str | None = Field(
        None,
        description=(
            "Python format string over a row's fields, e.g. 'Question: {question}\\nAnswer:'; "
            "null: the prompt_key field as is."
        ),
    )
    answer_key: str | None = Field(
        None, description="Field holding the reference answer, copied to metadata['answer'] (what rewards read)."
    )
    messages_key: str = Field(
        "messages",
        description="Field holding a chat (a list of {role, content}) in rows without the prompt_key field; rendered "
        "by model.path's chat template.",
    )

    @field_validator("template")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        if value is not None:
            template_fields(value)
        return value


class JsonlConfig(FileDatasetConfig):
    """Options of ``jsonl``."""

    path: str = Field(description="Local .jsonl file: one JSON object per line.")


class ParquetConfig(FileDatasetConfig):
    """Options of ``parquet``."""

    path: str = Field(description="Local .parquet file, or a directory whose *.parquet files are read in name order.")


class HfDiskConfig(FileDatasetConfig):
    """Options of ``hf_disk``."""

    path: str = Field(description="Directory written by Hugging Face datasets' save_to_disk (never downloaded).")
    split: str | None = Field(
        None, description="Split to read when the directory holds several (a DatasetDict); null when it holds one."
    )


def _import(module: str, backend: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise ConfigError(f"the {backend!r} dataset needs {top}, which is not installed: {DATA_EXTRA_HINT}") from exc


def _fields(row: Mapping[str, Any]) -> str:
    return ", ".join(repr(k) for k in row) or "none"


class _RecordBuilder:
    """Turns rows (mappings) into :class:`PromptRecord`, naming the row on any problem."""

    def __init__(self, config: FileDatasetConfig) -> None:
        self.config = config
        self.template = config.template
        self.needed = {config.prompt_key} | template_fields(config.template or "")
        if config.answer_key:
            self.needed.add(config.answer_key)

    def _chat(self, fields: Iterable[str]) -> bool:
        """Whether rows with these fields are chats: a messages field and no prompt field (nor a template)."""
        fields = set(fields)
        return self.template is None and self.config.messages_key in fields and self.config.prompt_key not in fields

    def check_columns(self, columns: Iterable[str], where: str) -> None:
        """For columnar sources: every field the options name exists (checked once, before any row)."""
        columns = list(columns)
        needed = self.needed - {self.config.prompt_key} if self._chat(columns) else self.needed
        missing = sorted(needed - set(columns))
        if missing:
            raise ConfigError(
                f"{where}: no field {', '.join(repr(m) for m in missing)} ({self._which(missing)}); "
                f"available fields: {', '.join(repr(c) for c in columns) or 'none'}"
            )

    def _which(self, missing: list[str]) -> str:
        roles = []
        for name in missing:
            if name == self.config.prompt_key:
                roles.append("data.options.prompt_key")
            elif name == self.config.answer_key:
                roles.append("data.options.answer_key")
            else:
                roles.append("used by data.options.template")
        return "; ".join(dict.fromkeys(roles))

    def build(self, index: int, row: Mapping[str, Any], where: str) -> PromptRecord:
        cfg = self.config
        if self._chat(row):
            return self._build_chat(index, row, where)
        missing = sorted(self.needed - set(row))
        if missing:
            raise ConfigError(
                f"{where}: no field {', '.join(repr(m) for m in missing)} ({self._which(missing)}); "
                f"available fields: {_fields(row)}"
            )
        if cfg.messages_key in row and row[cfg.messages_key] is not None:
            raise ConfigError(f"{where}: the row has both a prompt and {cfg.messages_key!r}; keep one "
                              f"(a chat is rendered by the chat template, a prompt is encoded as it is)")
        if row[cfg.prompt_key] is None:
            raise ConfigError(f"{where}: field {cfg.prompt_key!r} is empty (null)")
        if self.template is None:
            prompt = row[cfg.prompt_key]
            if not isinstance(prompt, str):
                raise ConfigError(
                    f"{where}: field {cfg.prompt_key!r} is {type(prompt).__name__}, not text; "
                    "point prompt_key at a text field or build the prompt with a template"
                )
        else:
            try:
                prompt = self.template.format(**row)
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
                raise ConfigError(
                    f"{where}: template {self.template!r} failed: {exc!r}; available fields: {_fields(row)}"
                ) from None
        meta = {k: v for k, v in row.items() if k != cfg.prompt_key}
        if cfg.answer_key:
            if row[cfg.answer_key] is None:
                raise ConfigError(f"{where}: answer field {cfg.answer_key!r} is empty (null)")
            meta["answer"] = row[cfg.answer_key]
        return PromptRecord(index=index, prompt=prompt, metadata=meta)

    def _build_chat(self, index: int, row: Mapping[str, Any], where: str) -> PromptRecord:
        cfg = self.config
        messages = check_messages(row[cfg.messages_key], where)
        meta = {k: v for k, v in row.items() if k != cfg.messages_key}
        meta["messages"] = messages
        if cfg.answer_key:
            if row.get(cfg.answer_key) is None:
                raise ConfigError(f"{where}: no answer field {cfg.answer_key!r} (data.options.answer_key); "
                                  f"available fields: {_fields(row)}")
            meta["answer"] = row[cfg.answer_key]
        users = [m["content"] for m in messages if m["role"] == "user"]
        return PromptRecord(index=index, prompt=users[-1] if users else messages[-1]["content"], metadata=meta)


class _InMemory(Dataset):
    """Records built once at construction; indices are row positions."""

    _records: list[PromptRecord]

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> PromptRecord:
        if not 0 <= index < len(self._records):
            raise IndexError(f"record {index} out of range for {len(self._records)} records")
        return self._records[index]


class JsonlDataset(_InMemory):
    """One JSON object per line; blank lines are skipped.

    A missing file, a line that is not a JSON object, a row without a field
    the options name, or a template that fails is a :class:`ConfigError`
    naming the file and line.
    """

    def __init__(self, config: JsonlConfig) -> None:
        path = Path(config.path)
        if not path.is_file():
            raise ConfigError(f"data.options.path: {str(path)!r} is not a file")
        builder = _RecordBuilder(config)
        self._records = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict):
                    raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                self._records.append(builder.build(len(self._records), obj, where))


class ParquetDataset(_InMemory):
    """Rows of one Parquet file, or of every ``*.parquet`` in a directory (name order); needs ``pyarrow``.

    Field problems are reported before any row is read, with the file's
    columns; row problems name the file and the row number (0-based, within the file).
    """

    def __init__(self, config: ParquetConfig) -> None:
        pq = _import("pyarrow.parquet", "parquet")
        path = Path(config.path)
        if path.is_dir():
            files = sorted(path.glob("*.parquet"))
            if not files:
                raise ConfigError(f"data.options.path: directory {str(path)!r} holds no *.parquet file")
        elif path.is_file():
            files = [path]
        else:
            raise ConfigError(f"data.options.path: {str(path)!r} does not exist")
        builder = _RecordBuilder(config)
        self._records = []
        for file in files:
            try:
                table = pq.read_table(file)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for unreadable files
                raise ConfigError(f"{file}: not a readable Parquet file ({exc})") from None
            builder.check_columns(table.column_names, str(file))
            for row_no, row in enumerate(table.to_pylist()):
                self._records.append(builder.build(len(self._records), row, f"{file}: row {row_no}"))


class HfDiskDataset(_InMemory):
    """A Hugging Face ``datasets`` directory written by ``save_to_disk``, read with ``load_from_disk``.

    Nothing is downloaded. A directory holding several splits needs ``split``;
    the error lists the splits there are.
    """

    def __init__(self, config: HfDiskConfig) -> None:
        hf = _import("datasets", "hf_disk")
        path = Path(config.path)
        if not path.is_dir():
            raise ConfigError(
                f"data.options.path: {str(path)!r} is not a directory (expected one written by save_to_disk)"
            )
        try:
            loaded = hf.load_from_disk(str(path))
        except FileNotFoundError as exc:
            raise ConfigError(
                f"data.options.path: {str(path)!r} is not a directory written by datasets' save_to_disk ({exc})"
            ) from None
        where = str(path)
        if isinstance(loaded, hf.DatasetDict):
            splits = list(loaded)
            if config.split is None and len(splits) == 1:
                config_split = splits[0]
            elif config.split is None:
                raise ConfigError(f"{path} holds splits {splits}; choose one with data.options.split")
            elif config.split not in loaded:
                raise ConfigError(f"data.options.split: {path} has no split {config.split!r}; it has {splits}")
            else:
                config_split = config.split
            loaded = loaded[config_split]
            where = f"{path} [{config_split}]"
        elif config.split is not None:
            raise ConfigError(f"data.options.split: {path} holds a single dataset, not splits; remove split")
        builder = _RecordBuilder(config)
        builder.check_columns(loaded.column_names, where)
        self._records = [builder.build(i, row, f"{where}: row {i}") for i, row in enumerate(loaded)]


@hookimpl
def asyncflow_datasets():
    yield DatasetBackend(
        name="jsonl",
        factory=JsonlDataset,
        config_model=JsonlConfig,
        description="Prompts from a local JSONL file, other fields kept as metadata for rewards.",
    )
    yield DatasetBackend(
        name="parquet",
        factory=ParquetDataset,
        config_model=ParquetConfig,
        description="Prompts from local Parquet file(s) (needs pyarrow), other columns kept as metadata.",
    )
    yield DatasetBackend(
        name="hf_disk",
        factory=HfDiskDataset,
        config_model=HfDiskConfig,
        description="Prompts from a Hugging Face datasets directory saved with save_to_disk (no download).",
    )
