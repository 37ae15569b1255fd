"""Blocking environments for the worker-pool concurrency tests, importable by name (spawned workers build them).

A gated step blocks its thread with ``time.sleep`` polling (no ``await``): it writes a marker file
``<dir>/entered-<pid>-<n>`` when it starts, then waits until ``<dir>/go`` exists (bounded by ``bound_s``,
so a wrong implementation ends with a visible answer instead of hanging the test). While it waits it
counts how many gated steps of its process are inside at once; ``info["peak"]`` is that count's highest
value seen by the time the step leaves, ``reward`` 1 if it saw the go file.

The module is also a plugin (``Gated`` as ``pool_fixtures_gated``) for a test that registers it by hand.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

from asyncflow_core.interfaces import Action, Environment, EnvironmentFeatures, Observation, Step
from asyncflow_core.plugins import EnvironmentBackend, hookimpl

_lock = threading.Lock()
_inside = 0  #: gated steps of this process inside now
_peak = 0  #: the most seen at once in this process
_entries = itertools.count()


def _enter() -> int:
    global _inside, _peak
    with _lock:
        _inside += 1
        _peak = max(_peak, _inside)
        return next(_entries)


def _leave() -> int:
    global _inside
    with _lock:
        _inside -= 1
        return _peak


def gate(record: dict) -> Step:
    """One blocking gated step (see the module docstring)."""
    folder = Path(record["dir"])
    n = _enter()
    try:
        (folder / f"entered-{os.getpid()}-{n}").touch()
        go = folder / "go"
        deadline = time.monotonic() + float(record.get("bound_s", 60.0))
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.005)  # blocks this thread (and, without a thread of its own, its whole loop)
        seen = go.exists()
    finally:
        peak = _leave()
    return Step(None, reward=float(seen), done=True,
                info={"peak": peak, "pid": os.getpid(), "thread": threading.get_ident()})


class Gated(Environment):
    """Declares ``blocking``; its first step is gated when the record has ``dir`` (else it ends at once)."""

    features = EnvironmentFeatures(owns_reward=True, blocking=True)

    def __init__(self) -> None:
        self.record: dict = {}

    async def reset(self, record, *, seed):
        self.record = dict(record)
        return Observation(text=f"go {seed}")

    async def step(self, action: Action) -> Step:
        if self.record.get("dir") and action.turn == 0:
            return gate(self.record)
        done = action.turn + 1 >= int(self.record.get("turns", 1))
        return Step(None if done else Observation(text=f" ok{action.turn}:"), reward=1.0 if done else 0.0,
                    done=done, info={"pid": os.getpid()})

    async def close(self) -> None:
        return None


def make_gated() -> Gated:
    return Gated()


def entered(folder: Path) -> int:
    """How many gated steps have started (marker files in ``folder``)."""
    return sum(1 for p in folder.iterdir() if p.name.startswith("entered-"))


#: the name this module registers ``Gated`` under, when a test registers the module by hand
PLUGIN_NAME = "pool_fixtures_gated"


@hookimpl
def asyncflow_environments():
    yield EnvironmentBackend(name=PLUGIN_NAME, factory=lambda config: Gated(),
                             description="Gated test environment (tests/envs/pool_fixtures.py).",
                             features=EnvironmentFeatures(owns_reward=True, blocking=True))
