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


class Replayable(Environment):
    """Declares ``restore: replay``; kills its worker process on demand, once (tests/flow/test_episode_recovery.py).

    Record keys: ``turns`` (steps until done), ``dir`` (a folder the episodes share). Every step 1 touches
    ``dir/at1-<index>`` as it starts: that row's step 0 answer has reached the driver (which sent step 1 after it),
    so step 0 is recorded. The row with ``exit_at`` (1) waits there until ``others`` other rows are there too (a
    marker at step 0 would race: a step 0 that had started may not have answered when the process dies, and its
    replay is then a bare reset, which matches whatever the rebuilt environment says), then,
    while ``dir/flag`` exists, removes it (so its replay does not exit again) and ``os._exit``s: every environment
    in the process is lost. Until the flag is gone the other rows wait at their step 1 (still open when it dies).
    The exit first creates ``dir/exited``: an environment of a ``diverge`` row reset after that (a rebuild) adds
    one more character to every observation, so its replay cannot match what was recorded.

    ``block_at`` instead holds the row's process at that turn (``time.sleep``, once ``others`` rows have reset:
    each reset touches ``dir/reset-<index>``) until the pool's time-out restarts the worker, ``dir/blocked``
    marking it. The ``hold`` rows wait at step 0 for that mark (so every later call of theirs starts after the
    blocked one), take ``hold_s`` at step 1 (so their next call times out well after it) and wait at step 2 until
    their worker is gone (so they are open there when it goes). Environments reset after the mark (rebuilt) do
    not wait.
    """

    features = EnvironmentFeatures(owns_reward=True, blocking=True, deterministic=True, restore="replay")

    def __init__(self) -> None:
        self.record: dict = {}
        self.shifted = self.rebuilt = False

    async def reset(self, record, *, seed):
        self.record = dict(record)
        self.shifted = bool(self.record.get("diverge")) and (Path(self.record["dir"]) / "exited").exists()
        self.rebuilt = (Path(self.record["dir"]) / "blocked").exists()
        (Path(self.record["dir"]) / f"reset-{self.record['index']}").touch()
        return Observation(text=self.record["prompt"])

    async def _wait(self, ready, bound_s: float = 60.0) -> None:
        deadline = time.monotonic() + bound_s  # bounded: a wrong implementation fails visibly instead of hanging
        while not ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def step(self, action: Action) -> Step:
        rec, turn = self.record, action.turn
        folder = Path(rec["dir"])
        flag = folder / "flag"
        if turn == 1:
            (folder / f"at1-{rec['index']}").touch()
        if rec.get("exit_at") == turn and flag.exists():
            await self._wait(lambda: len(list(folder.glob("at1-*"))) >= rec.get("others", 0) + 1)
            (folder / "exited").touch()
            flag.unlink()
            os._exit(3)
        if rec.get("block_at") == turn and not self.rebuilt:
            await self._wait(lambda: len(list(folder.glob("reset-*"))) >= rec.get("others", 0) + 1)
            (folder / "blocked").touch()
            time.sleep(rec.get("bound_s", 60))  # holds the process: only the pool's time-out ends it
        if rec.get("hold") and not self.rebuilt:
            if turn == 0:
                await self._wait(lambda: (folder / "blocked").exists())
            if turn == 1:
                await asyncio.sleep(rec.get("hold_s", 0.0))
            if turn == 2:
                await self._wait(lambda: False, rec.get("bound_s", 60))  # until the worker is restarted
        if turn == 1 and "exit_at" not in rec and not rec.get("hold"):
            await self._wait(lambda: not flag.exists())
        done = turn + 1 >= rec["turns"]
        extra = "a" if self.shifted else ""
        return Step(None if done else Observation(text=f" ok{turn}:{extra}"), reward=0.5 + turn, done=done,
                    info={"tool_calls": 1, "tool_ok": True, "pid": os.getpid()})


class ResetOnly(Replayable):
    """:class:`Replayable` that declares ``restore: reset`` (a lost environment restarts its episode)."""

    features = EnvironmentFeatures(owns_reward=True, blocking=True, deterministic=True, restore="reset")


def make_replayable() -> Replayable:
    return Replayable()


def make_reset_only() -> ResetOnly:
    return ResetOnly()
