"""Turning pydantic validation errors into one readable line per problem."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def _loc(prefix: str, loc: tuple[Any, ...]) -> str:
    parts = [prefix] if prefix else []
    parts += [str(p) for p in loc]
    return ".".join(parts) or "<root>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_validation_error(exc: ValidationError, *, prefix: str = "", model: type | None = None) -> str:
    """``field: problem (got value)`` for each error, joined with ``; ``.

    Unknown keys say which keys are allowed, so a typo is one look away from its fix.
    """
    messages = []
    for err in exc.errors(include_url=False):
        loc = _loc(prefix, err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(model, err["loc"])
            hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
            messages.append(f"{loc}: unknown field{hint}")
        elif kind == "missing":
            messages.append(f"{loc}: required field is missing")
        else:
            msg = err["msg"]
            got = f" (got {_short(err['input'])})" if "input" in err and not isinstance(err["input"], dict) else ""
            messages.append(f"{loc}: {msg}{got}")
    return "; ".join(messages)


def _allowed_keys(model: type | None, loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model that owns ``loc[:-1]``, found by walking the model's fields."""
    if model is None:
        return []
    from pydantic import BaseModel

    current: Any = model
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                field = next((f for f in current.model_fields.values() if f.alias == part), None)
            if field is None:
                return []
            current = field.annotation
        else:
            return []
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or name for name, f in current.model_fields.items()]
    return []
