"""The driver's start-up heap, kept out of the garbage collector's full passes while a run steps.

By the first step the driver holds a large heap that lives as long as the run
(torch, transformers, the model, the plugins; 368,000 objects the collector
tracks after the imports alone). Every full (oldest-generation) collection
walks all of it: a 155-460 ms pause on this CPU about once a 60-step run of
the example, with the GIL held, so the rollout engine's thread stops with it
(docs/performance.md, "Against TRL's GRPOTrainer"). :func:`gc.freeze` moves
what exists at the first step to a permanent generation the collector skips;
the run's own garbage is collected as before. :func:`thaw` gives the frozen
objects back to the collector when the run stops, so a process that runs
several flows (tests) frees what an earlier run left.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["fewer_full_collections", "freeze_startup", "thaw"]

#: during :func:`fewer_full_collections`: a full collection after this many of the middle generation (default 10)
FULL_GC_EVERY = 100


def freeze_startup() -> None:
    """Exempt every object alive now from later collections (until :func:`thaw`)."""
    gc.freeze()


def thaw() -> None:
    """Hand the frozen objects back to the collector (their oldest generation)."""
    gc.unfreeze()


@contextlib.contextmanager
def fewer_full_collections() -> Iterator[None]:
    """Run the collector's full passes 1/10 as often inside (the young generations, which free most cyclic
    garbage, as before); the thresholds are restored after, also when the body raises.

    For a simulated run (:func:`asyncflow_core.flow.clock.run_virtual`): one CPU-bound loop over a large heap
    whose rows and results churn, where each full pass walks the whole heap (~8 % of a 1,024-device run at the
    default rate).
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], FULL_GC_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
