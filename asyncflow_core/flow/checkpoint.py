"""Resumable checkpoints of a run: the trainer's own checkpoint plus the runtime's sample accounting.

Layout under the run directory::

    config.yaml                    the run's config, as validated (``--resume`` reads it)
    checkpoints/step_000040/       one checkpoint per saved version
        trainer/                   TrainEngine.save (model, optimizer, version, RNG)
        state.json                 version, prompts trained and dropped, the data order's fingerprint
    checkpoints/latest             name of the newest complete checkpoint

A checkpoint directory is written under a temporary name and renamed when
complete, and ``latest`` is replaced atomically, so a run killed mid-save
resumes from the previous checkpoint.

What resuming restores: the trainer (weights, optimizer, version), the
prompts already trained on or dropped (by their position in the seeded data
order: ``epoch * len(dataset) + index``), and that order itself. Prompts that
were generated or in flight but not yet trained at the checkpoint are not
recorded as consumed, so the resumed run generates them again with the
restored weights: no prompt is trained on twice and none is skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.telemetry import Timeline

log = logging.getLogger("asyncflow.flow")

LATEST = "latest"
STATE = "state.json"


@dataclass
class CheckpointState:
    version: int
    trained: list[int]  #: prompt uids trained on
    dropped: dict[int, str]  #: prompt uid -> reason
    data: dict[str, Any]  #: fingerprint of the data order (size, seed, shuffle, epochs)
    counters: dict[str, int] = field(default_factory=dict)  #: the ledger's counters at the checkpoint
    tokens_trained: int = 0

    def to_json(self) -> str:
        d = asdict(self)
        d["dropped"] = {str(k): v for k, v in self.dropped.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> CheckpointState:
        d = json.loads(text)
        d["dropped"] = {int(k): v for k, v in d["dropped"].items()}
        return cls(**d)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, version: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{version:06d}"


async def save_checkpoint(run_dir: Path, trainer: Any, state: CheckpointState, *, keep: int) -> Path:
    """Write ``trainer`` and ``state`` as the checkpoint of ``state.version``; keep the newest ``keep``."""
    root = checkpoint_root(run_dir)
    final = step_dir(run_dir, state.version)
    tmp = root / f".tmp_{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    await trainer.save(tmp / "trainer")
    (tmp / STATE).write_text(state.to_json())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    kept = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> tuple[Path, CheckpointState]:
    """The newest complete checkpoint of ``run_dir``, or a ConfigError saying why there is none."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        raise ConfigError(
            f"{run_dir} has no checkpoint to resume from (no {pointer}); the run must have been started with "
            "trainer.checkpoint_every > 0 and have finished at least that many steps"
        )
    path = root / pointer.read_text().strip()
    try:
        state = CheckpointState.from_json((path / STATE).read_text())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc})") from exc
    return path, state


@dataclass
class Checkpointer:
    """Saves a checkpoint on every ``every``-th published version and the last one (a ``VersionPublished`` subscriber).

    It holds the trainer's lock while saving (the trainer runs one call at a
    time) and records a ``checkpoint`` span on the train lane.
    """

    run_dir: Path
    trainer: Any
    ledger: Ledger
    data: dict[str, Any]  #: the data order's fingerprint
    tokens: Callable[[], int]  #: tokens trained so far (the step logger's count)
    every: int
    total_steps: int
    keep: int
    lock: asyncio.Lock
    timeline: Timeline

    async def on_version_published(self, event: VersionPublished) -> None:
        version = event.version
        if version % self.every and version < self.total_steps:
            return
        with self.timeline.span("train", "checkpoint"):
            async with self.lock:
                led = self.ledger
                state = CheckpointState(version=version, trained=sorted(led.trained), dropped=dict(led.dropped),
                                        data=self.data, counters=dict(led.counters), tokens_trained=self.tokens())
                where = await save_checkpoint(self.run_dir, self.trainer, state, keep=self.keep)
        log.info("checkpoint of version %d in %s", version, where)
