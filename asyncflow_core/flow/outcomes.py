"""Row outcomes: what became of each store row, settled in one place.

A row is ``ok`` until a stage settles it otherwise, once (the first reason
wins):

- ``failed``: a stage raised on it, or its engine or reward reported an error
  (:meth:`RowOutcomes.fail`, counted ``failed_<stage>``);
- ``filtered``: a stage or the algorithm dropped it on purpose, e.g. dynamic
  sampling (:meth:`RowOutcomes.filter`, counted ``filtered_<stage>``);
- ``stale``: its generation can no longer be used and ``async.stale_policy``
  is ``drop`` (:meth:`RowOutcomes.stale`, counted ``stale_rows_dropped``);
- ``dropped``: the row itself is fine but another row of its prompt group is
  settled, so the group goes as a whole (:meth:`RowOutcomes.of_rows`).

Later stages skip settled rows and write placeholders for them
(:func:`merge_outputs`); the trainer drops each group holding a settled row
with the most important reason of its rows (failed > filtered > stale,
:meth:`RowOutcomes.group_reasons`), which is the reason the ledger records.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from asyncflow_core.types import Batch, Column, RaggedTensor


class RowOutcome(enum.Enum):
    """What became of a row; the value is the reason word in counters and the ledger (``dropped_<value>``)."""

    OK = "ok"
    FAILED = "failed"
    FILTERED = "filtered"
    STALE = "stale"
    DROPPED = "dropped"


#: why a group is dropped when its rows were settled for different reasons, most important first
_RANK = {RowOutcome.FAILED: 0, RowOutcome.FILTERED: 1, RowOutcome.STALE: 2}


@dataclass(frozen=True)
class RowReason:
    """Why a row was settled: the outcome, the stage that settled it (None for staleness), the error text."""

    outcome: RowOutcome
    stage: str | None = None
    detail: str = ""

    def __str__(self) -> str:
        """The one-line form: ``stale``, ``filtered:<stage>`` or ``<stage>: <error>``."""
        if self.outcome is RowOutcome.FAILED:
            return f"{self.stage}: {self.detail}"
        if self.outcome is RowOutcome.FILTERED:
            return f"filtered:{self.stage}"
        return self.outcome.value


class RowOutcomes:
    """The run's settled rows (row id -> :class:`RowReason`) and their counters.

    ``counters`` returns the run's event counters at call time (the runtime
    swaps in the launcher's set after the context is built).
    """

    def __init__(self, counters: Callable[[], Counter[str]]) -> None:
        self._counters = counters
        self.reasons: dict[int, RowReason] = {}

    def _settle(self, rows: Iterable[int], reason: RowReason) -> None:
        for r in rows:
            self.reasons.setdefault(int(r), reason)

    def fail(self, stage: str, rows: Iterable[int], detail: str) -> None:
        """Rows ``stage`` failed on, with the error."""
        rows = [int(r) for r in rows]
        self._settle(rows, RowReason(RowOutcome.FAILED, stage, detail))
        self._counters()[f"failed_{stage}"] += len(rows)

    def filter(self, stage: str, rows: torch.Tensor | Iterable[int]) -> None:
        """Rows ``stage`` dropped on purpose (their groups are dropped as ``filtered``)."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else [int(r) for r in rows]
        self._settle(rows, RowReason(RowOutcome.FILTERED, stage))
        self._counters()[f"filtered_{stage}"] += len(rows)

    def stale(self, row: int) -> None:
        """A row whose generation can no longer be used, under ``stale_policy: drop``."""
        self._settle([row], RowReason(RowOutcome.STALE))
        self._counters()["stale_rows_dropped"] += 1

    def failures(self) -> int:
        """Rows failed so far, over every stage (what ``pipeline.max_failure_rate`` bounds)."""
        return sum(v for k, v in self._counters().items() if k.startswith("failed_"))

    def outcome(self, row: int) -> RowOutcome:
        reason = self.reasons.get(int(row))
        return RowOutcome.OK if reason is None else reason.outcome

    def mask(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Bool per row: settled (not ``ok``)."""
        if not self.reasons:
            return torch.zeros(row_ids.numel(), dtype=torch.bool)
        return torch.tensor([int(r) in self.reasons for r in row_ids.tolist()], dtype=torch.bool)

    def group_mask(self, row_ids: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Bool per row: settled, or in a group with a settled row (the row is ``dropped`` with its group)."""
        own = self.mask(row_ids)
        return torch.isin(group_ids, group_ids[own]) if bool(own.any()) else own

    def of_rows(self, row_ids: torch.Tensor, group_ids: torch.Tensor) -> list[RowOutcome]:
        """Each row's outcome, ``dropped`` for an ``ok`` row whose group holds a settled row."""
        gone = self.group_mask(row_ids, group_ids).tolist()
        own = [self.outcome(r) for r in row_ids.tolist()]
        return [RowOutcome.DROPPED if g and o is RowOutcome.OK else o for o, g in zip(own, gone, strict=True)]

    def group_reasons(self, row_ids: torch.Tensor, group_ids: torch.Tensor) -> dict[int, RowOutcome]:
        """Group id -> why it is dropped (failed > filtered > stale), for the groups with a settled row."""
        reasons: dict[int, RowOutcome] = {}
        if not self.reasons:
            return reasons
        for gid, row in zip(group_ids.tolist(), row_ids.tolist(), strict=True):
            reason = self.reasons.get(int(row))
            if reason is not None and (gid not in reasons or _RANK[reason.outcome] < _RANK[reasons[gid]]):
                reasons[gid] = reason.outcome
        return reasons


def merge_outputs(batch: Batch, good: torch.Tensor, values: Mapping[str, Column],
                  fill: Mapping[str, Column]) -> dict[str, Column]:
    """Outputs computed for rows ``good`` of ``batch``, with the placeholders ``fill`` for the others (row order kept)."""
    n = batch.num_rows
    if good.numel() == n:
        return dict(values)
    pos = torch.full((n,), -1, dtype=torch.int64)
    pos[good] = torch.arange(good.numel())
    out: dict[str, Column] = {}
    for name, filler in fill.items():
        v = values[name]
        rows: list[Column] = []
        for i in range(n):
            src, j = (v, int(pos[i])) if pos[i] >= 0 else (filler, i)
            rows.append(src.select(torch.tensor([j])) if isinstance(src, RaggedTensor) else src[j : j + 1])
        out[name] = RaggedTensor.cat(rows) if isinstance(rows[0], RaggedTensor) else torch.cat(rows)  # type: ignore[arg-type]
    return out
