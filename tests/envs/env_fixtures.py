"""Environments for the pool tests, importable by name so worker processes (spawned) can build them."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from asyncflow_core.interfaces import Action, Environment, EnvironmentFeatures, Observation, Step

#: closes seen in this process (in-loop tests read it)
CLOSED: list[str] = []


class Scripted(Environment):
    """``record["mode"]`` picks a behaviour at ``record["at"]`` (turn): ok, raise, hang, block, wait_file."""

    features = EnvironmentFeatures(owns_reward=True, blocking=True)

    def __init__(self) -> None:
        self.record: dict = {}

    async def reset(self, record, *, seed):
        self.record = dict(record)
        if self.record.get("mode") == "raise_reset":
            raise RuntimeError("no such task")
        return Observation(text=f"go {seed}")

    async def step(self, action: Action) -> Step:
        mode, at = self.record.get("mode", "ok"), self.record.get("at", 0)
        if action.turn == at:
            if mode == "raise":
                raise ValueError("boom")
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "block":
                time.sleep(3600)  # holds its whole process: only a worker process can survive this
            if mode == "wait_file":
                # blocks its process until the test's event loop creates the file (bounded, so a wrong
                # implementation ends the test with a visible answer instead of hanging it)
                path = Path(self.record["path"])
                deadline = time.monotonic() + self.record.get("bound_s", 60)
                while not path.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                return Step(None, reward=float(path.exists()), done=True, info={"pid": os.getpid()})
            if mode == "bad_step":
                return "not a step"  # type: ignore[return-value]
        done = action.turn >= self.record.get("turns", 1) - 1
        return Step(None if done else Observation(text="more"), reward=1.0 if done else 0.0, done=done,
                    info={"pid": os.getpid()})

    async def close(self) -> None:
        CLOSED.append(str(self.record.get("name", "")))
        if self.record.get("mode") == "raise_close":
            raise OSError("cannot release")


def make_scripted() -> Scripted:
    return Scripted()
