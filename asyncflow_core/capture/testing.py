"""Test support for captured runs: an agent package on disk, a recording engine, and the sampled-token check.

A captured run trains on what the engine sampled for each call an agent
made. The tests of every engine and launcher check it the same way: each
maximal run of loss-mask 1 in a trained row must be one engine result,
sampled after exactly the tokens before it, and a tool message's tokens
must all be mask 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["masked_runs", "recording", "sampled_after", "tool_message_hits", "write_agent_package"]


def write_agent_package(root: Path, package: str, source: str, monkeypatch: Any) -> str:
    """Write ``source`` as ``<root>/<package>/tooling.py``, put ``root`` on ``sys.path``; the ``agent.entry``."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    (root / package / "tooling.py").write_text(source)
    monkeypatch.syspath_prepend(str(root))
    return f"{package}.tooling:agent"


def recording(engine_cls: type) -> type:
    """A subclass of the rollout engine ``engine_cls`` that keeps every request and result (class lists)."""

    class Recording(engine_cls):  # type: ignore[misc, valid-type]
        requests: list = []
        results: list = []

        async def generate(self, requests):
            Recording.requests.extend(requests)
            async for res in super().generate(requests):
                Recording.results.append(res)
                yield res

    Recording.__name__ = Recording.__qualname__ = f"Recording{engine_cls.__name__}"
    return Recording


def sampled_after(pairs: Iterable[tuple[Any, Any]]) -> dict[tuple[int, ...], list[tuple[list[int], list[float]]]]:
    """Each prompt a finished request was sampled after -> what the engine returned for it (tokens, log-probs)."""
    out: dict[tuple[int, ...], list[tuple[list[int], list[float]]]] = {}
    for q, res in pairs:
        if res is not None and res.finish_reason.value in ("stop", "length"):
            out.setdefault(tuple(q.prompt_token_ids), []).append((list(res.token_ids), list(res.logprobs)))
    return out


def masked_runs(prompt: Sequence[int], response: Sequence[int],
                mask: Sequence[int]) -> Iterator[tuple[int, int, tuple[int, ...]]]:
    """Every maximal run of loss-mask 1 in ``response``: ``(start, end, the whole sequence before it)``."""
    full, k = list(prompt) + list(response), 0
    while k < len(response):
        if not mask[k]:
            k += 1
            continue
        end = k
        while end < len(response) and mask[end]:
            end += 1
        yield k, end, tuple(full[:len(prompt) + k])
        k = end


def tool_message_hits(response: Sequence[int], tool_ids: Sequence[int]) -> list[int]:
    """Where the tokens of a rendered tool message start in ``response``."""
    n = len(tool_ids)
    return [j for j in range(len(response) - n + 1) if list(response[j:j + n]) == list(tool_ids)]
