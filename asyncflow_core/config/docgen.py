"""Regenerate docs/config.md from the config models: ``python -m asyncflow_core.config.docgen > docs/config.md``."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from asyncflow_core.config.models import RunConfig

HEADER = """# Configuration reference

A run is one YAML file; every field below has this description in the code (`asyncflow_core/config/models.py`).
Component sections take `name` (a registered plugin, see `asyncflow plugins`) and `options` (validated by that plugin's config model; `asyncflow config show FILE` prints them with defaults).
Override any field on the command line with dotted paths: `asyncflow config validate run.yaml trainer.total_steps=100 rollout.options.vocab_size=32`.
This file is generated: `python -m asyncflow_core.config.docgen > docs/config.md`.
"""


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("|", "\\|")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default if field.default_factory is None else field.default_factory()
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    return repr(value).replace("|", "\\|")


def render() -> str:
    lines = [HEADER, "## top level", "", "| field | description |", "|---|---|"]
    sections = []
    for name, field in RunConfig.model_fields.items():
        lines.append(f"| `{field.alias or name}` | {field.description} |")
        ann = field.annotation
        optional = [a for a in getattr(ann, "__args__", ()) if a is not type(None)]
        if len(optional) == 1 and len(getattr(ann, "__args__", ())) == 2:
            ann = optional[0]  # an optional section (``X | None``) is documented as X
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sections.append((field.alias or name, ann))
    while sections:
        key, model = sections.pop(0)
        doc = (model.__doc__ or "").strip().splitlines()[0]
        lines += ["", f"## `{key}` — {doc}", "", "| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            lines.append(f"| `{field.alias or name}` | {_type(field.annotation)} | {_default(field)} | {field.description} |")
            # a list of records (eval.datasets[]) gets its own table after this one
            args = getattr(field.annotation, "__args__", ())
            if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                sections.insert(0, (f"{key}.{field.alias or name}[]", args[0]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
