"""Sample accounting: every admitted prompt ends trained once, dropped (with a reason), or unfinished at stop.

The ledger works per prompt *group* (one prompt, ``n`` samples = ``n`` store
rows sharing a ``group_id``): that is the unit the feeder admits, the trainer
uses whole, and a stale or failed group is re-queued or dropped as. Per-row
state lives in the store; this is Python-side bookkeeping per group only.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from asyncflow_core.flow.outcomes import RowOutcome
from asyncflow_core.types import PromptRecord


@dataclass
class GroupInfo:
    group_id: int
    prompt_uid: int  #: epoch * len(dataset) + index: one admission of one dataset record
    record: PromptRecord
    attempt: int = 0  #: 0 for the first try, +1 per re-queue
    start_floor: int = 0  #: oldest weights its requests start on (:func:`~asyncflow_core.flow.staleness.start_floor`)


@dataclass
class Ledger:
    """Admissions, re-queues, drops and trained groups; checks that nothing is counted twice."""

    groups: dict[int, GroupInfo] = field(default_factory=dict)  #: live groups by group id
    requeue: deque[GroupInfo] = field(default_factory=deque)  #: prompts to start again (no new admission)
    admitted: int = 0  #: prompts admitted (each dataset record visit once)
    trained: set[int] = field(default_factory=set)  #: prompt uids trained on
    dropped: dict[int, str] = field(default_factory=dict)  #: prompt uid -> reason (a RowOutcome's value)
    counters: Counter[str] = field(default_factory=Counter)
    _next_group: int = 0

    def new_group(self, prompt_uid: int, record: PromptRecord, attempt: int = 0) -> GroupInfo:
        info = GroupInfo(self._next_group, prompt_uid, record, attempt)
        self._next_group += 1
        self.groups[info.group_id] = info
        return info

    def admit(self, prompt_uid: int, record: PromptRecord) -> GroupInfo:
        self.admitted += 1
        return self.new_group(prompt_uid, record)

    def start_floor(self, group_id: int) -> int:
        """The oldest weights a request of group ``group_id`` starts on (0 for a group no longer live)."""
        info = self.groups.get(group_id)
        return 0 if info is None else info.start_floor

    @property
    def net_started(self) -> int:
        """Admitted prompts not dropped for good: what the admission formula bounds."""
        return self.admitted - len(self.dropped)

    @property
    def outstanding(self) -> int:
        """Admitted prompts neither trained nor dropped yet."""
        return self.admitted - len(self.trained) - len(self.dropped)

    def mark_trained(self, group_id: int) -> None:
        info = self.groups.pop(group_id)
        if info.prompt_uid in self.trained or info.prompt_uid in self.dropped:
            raise AssertionError(f"prompt {info.prompt_uid} settled twice (group {group_id})")
        self.trained.add(info.prompt_uid)

    def mark_dropped(self, group_id: int, reason: RowOutcome) -> None:
        """Settle the group's prompt for good as ``reason`` (failed, filtered or stale; counted ``dropped_<reason>``)."""
        info = self.groups.pop(group_id)
        if info.prompt_uid in self.trained or info.prompt_uid in self.dropped:
            raise AssertionError(f"prompt {info.prompt_uid} settled twice (group {group_id})")
        self.dropped[info.prompt_uid] = reason.value
        self.counters[f"dropped_{reason.value}"] += 1

    def mark_requeued(self, group_id: int, reason: RowOutcome) -> None:
        """Start the group's prompt again as a new group (counted ``requeued_<reason>``)."""
        info = self.groups.pop(group_id)
        info.attempt += 1
        self.requeue.append(info)
        self.counters[f"requeued_{reason.value}"] += 1

    def summary(self) -> dict[str, Any]:
        return {
            "admitted": self.admitted,
            "trained": len(self.trained),
            "dropped": len(self.dropped),
            "unfinished": self.outstanding,
            **{k: int(v) for k, v in sorted(self.counters.items())},
        }
