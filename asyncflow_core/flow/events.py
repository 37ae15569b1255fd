"""Run events: what a stage announces, and the parts of a run that follow it.

:class:`Events` is a small in-process pub/sub on the run's context
(``FlowContext.events``). A subscriber is a function of the event, plain or
``async``; :meth:`Events.publish` calls the subscribers of the event's type
one after the other, in the order they subscribed, awaiting each before the
next starts, and returns once all have run. It adds no task switch of its
own: what a subscriber does not await runs before ``publish`` returns. An
exception in a subscriber stops the delivery and is raised to the publisher
(the train stage, so a failed checkpoint fails the run as before).

:class:`VersionPublished` is announced by the train stage after each step,
once the new version's weights are staged in the weight transport, the
context holds the new ``version`` and ``published`` version, and (colocated)
the rollout engines are awake again. Its subscribers, in this order:

1. the context (subscribed when it is built, so always first): wakes every
   waiter. This is how weight sync follows a version: each rollout replica's
   weight-sync task waits for ``published`` to pass its engine's version and
   then pulls the staged weights; the feeder looks at its admission bound
   again and the rollout's stale watch aborts requests that became unusable;
2. the weights canary (when enabled): starts its check of the version when
   one is due, beside the next batch's gathering;
3. the step logger: the step's metrics record (tokens trained so far);
4. checkpoints (``trainer.checkpoint_every``): saves every N-th version and
   the last, after the metrics so the checkpoint holds the step's tokens,
   and after the weights are staged, so a resume re-pushes weights that were
   published.

The train stage begins its next step only after ``publish`` returns, so the
trainer still holds the announced version while every subscriber runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from asyncflow_core.types import Batch

E = TypeVar("E")


@dataclass(frozen=True)
class VersionPublished:
    """The trainer published ``version``, its weights staged in the transport as ``staged``, after a step."""

    version: int  #: the trainer's version now (steps done)
    staged: int  #: the version the weight transport holds (what replicas pull)
    step: int  #: the version the step trained from (its metrics record is step ``step + 1``)
    batch: Batch  #: the rows the step trained on
    metrics: Mapping[str, float]  #: what the train engine reported for the step
    report: Any  #: the weight transport's send report (seconds, bytes)
    lag: torch.Tensor  #: per trained row, trainer version minus the row's oldest token version
    t_begin: float  #: run clock when the step began gathering its batch


@dataclass
class Events:
    """Subscribers per event type; see the module docstring for the delivery guarantees."""

    _subscribers: dict[type, list[tuple[str, Callable[[Any], Awaitable[None] | None]]]] = field(
        default_factory=dict, repr=False)

    def subscribe(self, kind: type[E], handler: Callable[[E], Awaitable[None] | None], *, name: str) -> None:
        """Call ``handler`` on every ``kind`` event, after the subscribers before it; ``name`` labels it."""
        self._subscribers.setdefault(kind, []).append((name, handler))

    def subscribers(self, kind: type) -> list[str]:
        """The names subscribed to ``kind``, in delivery order."""
        return [name for name, _ in self._subscribers.get(kind, [])]

    async def publish(self, event: Any) -> None:
        """Deliver ``event`` to its type's subscribers, one after the other."""
        for _, handler in list(self._subscribers.get(type(event), ())):
            result = handler(event)
            if inspect.isawaitable(result):
                await result
