"""Built-in datasets: ``jsonl`` (one JSON object per line, a prompt field and metadata)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import Dataset
from asyncflow_core.plugins import DatasetBackend, hookimpl
from asyncflow_core.types import PromptRecord


class JsonlConfig(BaseModel):
    """Options of ``jsonl``."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Local .jsonl file: one JSON object per line.")
    prompt_key: str = Field("prompt", description="Field holding the prompt text.")
    template: str = Field("{prompt}", description="Python format string applied to each record's fields.")


class JsonlDataset(Dataset):
    """Loads the file once; every other field of a line becomes the record's metadata.

    A missing file, a line that is not a JSON object, or one without the
    prompt field is a :class:`ConfigError` naming the file and line.
    """

    def __init__(self, config: JsonlConfig) -> None:
        path = Path(config.path)
        if not path.is_file():
            raise ConfigError(f"data.options.path: {str(path)!r} is not a file")
        self._records: list[PromptRecord] = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or config.prompt_key not in obj:
                    raise ConfigError(f"{path}:{lineno}: expected an object with a {config.prompt_key!r} field")
                try:
                    prompt = config.template.format(**obj)
                except (KeyError, IndexError, ValueError) as exc:
                    raise ConfigError(f"{path}:{lineno}: template {config.template!r} failed: {exc!r}") from None
                meta = {k: v for k, v in obj.items() if k != config.prompt_key}
                self._records.append(PromptRecord(index=len(self._records), prompt=prompt, metadata=meta))

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> PromptRecord:
        if not 0 <= index < len(self._records):
            raise IndexError(f"record {index} out of range for {len(self._records)} records")
        return self._records[index]


@hookimpl
def asyncflow_datasets():
    yield DatasetBackend(
        name="jsonl",
        factory=JsonlDataset,
        config_model=JsonlConfig,
        description="Prompts from a local JSONL file, other fields kept as metadata for rewards.",
    )
