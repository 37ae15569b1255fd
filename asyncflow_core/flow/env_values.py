"""What the multi-turn and captured episodes make of the values an environment hands back.

Small conversions kept apart from the episode classes: the record ``reset``
receives, whether its first observation is the row's stored prompt, numbers
and counts read from a step's ``info``, and a sync-or-async callable made
awaitable.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["awaitable", "count_of", "finite_number", "is_dataset_prompt", "record_for_env", "untraced"]


def record_for_env(record: Any) -> dict[str, Any]:
    """What ``reset`` receives: the record's metadata, with ``prompt``, ``index`` and ``prompt_token_ids``."""
    if record is None:
        return {}
    if isinstance(record, Mapping):
        return dict(record)
    return {**dict(record.metadata), "prompt": record.prompt, "index": record.index,
            "prompt_token_ids": tuple(record.prompt_token_ids)}


def is_dataset_prompt(record: Any, prompt: Sequence[int], obs: Any, tools: Sequence[Any]) -> bool:
    """``reset``'s observation ``obs`` is the row's own prompt, as the feeder rendered it into ``prompt`` (no
    tools: they change a template), so those tokens are the episode's prompt as they are."""
    if tools or record is None or isinstance(record, Mapping) or not prompt:
        return False
    if obs.text is not None:
        return obs.text == record.prompt and not record.prompt_token_ids and "messages" not in record.metadata
    if obs.messages is not None:
        return list(map(dict, obs.messages)) == list(map(dict, record.metadata.get("messages") or ()))
    return False


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
