"""What the multi-turn and captured episodes make of the values an environment hands back.

Small conversions kept apart from the episode classes: the record ``reset``
receives, numbers and counts read from a step's ``info``, and a sync-or-async
callable made awaitable.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["awaitable", "count_of", "finite_number", "record_for_env", "untraced"]


def record_for_env(record: Any) -> dict[str, Any]:
    """What ``reset`` receives: the record's metadata, with ``prompt``, ``index`` and ``prompt_token_ids``."""
    if record is None:
        return {}
    if isinstance(record, Mapping):
        return dict(record)
    return {**dict(record.metadata), "prompt": record.prompt, "index": record.index,
            "prompt_token_ids": tuple(record.prompt_token_ids)}


def finite_number(value: Any) -> float | None:
    """A finite int or float (bools count as 0/1), else None."""
    if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


@contextlib.contextmanager
def untraced(name: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield args


def count_of(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, Sequence) and not isinstance(value, str):
        return len(value)
    return 0


def awaitable(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        out = fn()
        return await out if inspect.isawaitable(out) else out

    return call
