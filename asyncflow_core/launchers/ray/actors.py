"""What runs inside the actors: each hosts one real backend built by its plugin's factory.

These are plain classes; :mod:`.launcher` turns them into Ray actors with
``ray.remote(...).options(...)``. They are *async* actors, so a health check,
an ``abort`` or a ``poll`` is served while a ``generate`` or a ``train_step``
is awaiting its compute.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncflow_core.types import GenerationRequest, GenerationResult, RewardInput, WeightBucket

_END = object()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling (the driver re-raises the engine's own error), else an EngineError."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any unpicklable exception: keep its type name and message
        from asyncflow_core.errors import EngineError

        return EngineError(f"{type(exc).__name__}: {exc}")
    return exc


class RolloutActor:
    """Hosts one :class:`~asyncflow_core.interfaces.RolloutEngine` replica.

    ``generate`` is split in two calls so that results leave the actor in
    completion order and in batches: ``submit`` starts the engine's iterator
    in a task feeding a queue, ``poll`` returns everything finished since the
    last poll (waiting for at least one result, up to ``wait_s``).
    """

    def __init__(self, factory: Any, options: Any) -> None:
        self.engine = factory(options)
        self.calls: dict[int, asyncio.Queue] = {}
        self.tasks: dict[int, asyncio.Task] = {}

    def describe(self) -> dict[str, Any]:
        return {"features": self.engine.features, "version": self.engine.version, "pid": os.getpid()}

    async def start(self) -> int:
        await self.engine.start()
        return self.engine.version

    async def submit(self, call_id: int, requests: Sequence[GenerationRequest]) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        self.calls[call_id] = queue

        async def pump() -> None:
            try:
                async for res in self.engine.generate(list(requests)):
                    queue.put_nowait(res)
                queue.put_nowait(_END)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - delivered to the driver, which decides
                queue.put_nowait(exc)

        self.tasks[call_id] = asyncio.ensure_future(pump())
        # let the engine take the requests in (up to its first await) before this call returns, as an in-process
        # generate() has once its caller yields: a pause or abort sent after submit then finds them in flight
        await asyncio.sleep(0)

    async def poll(self, call_id: int, wait_s: float) -> tuple[list[GenerationResult], bool, BaseException | None]:
        """Results finished since the last poll, whether the call ended, and the error it ended with."""
        queue = self.calls[call_id]
        items: list[Any] = []
        try:
            items.append(await asyncio.wait_for(queue.get(), wait_s))
        except TimeoutError:
            return [], False, None
        while not queue.empty():
            items.append(queue.get_nowait())
        results = [x for x in items if isinstance(x, GenerationResult)]
        tail = items[-1]
        if tail is _END or isinstance(tail, BaseException):
            self.calls.pop(call_id, None)
            self.tasks.pop(call_id, None)
            return results, True, None if tail is _END else _portable(tail)
        return results, False, None

    async def abort(self, request_ids: Sequence[str] | None) -> list[str]:
        return await self.engine.abort(request_ids)

    async def pause(self, mode: Any) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights_refs(self, version: int, refs: list[Any], kv_cache: Any) -> int:
        """Load a version whose buckets the driver put in the object store (fetched one by one, in order)."""
        async def stream():
            for ref in refs:
                bucket: WeightBucket = await ref
                yield bucket

        await self.engine.update_weights(version, stream(), kv_cache=kv_cache)
        return self.engine.version

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level)

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def health(self) -> Any:
        return await self.engine.health()

    async def shutdown(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await self.engine.shutdown()


class TrainActor:
    """Hosts the :class:`~asyncflow_core.interfaces.TrainEngine`.

    An engine that runs several ranks (``fsdp`` with ``world_size`` > 1)
    spawns them from inside this actor's process, as it would from the
    driver: the rank group is one actor's children, not one actor per rank.
    """

    def __init__(self, factory: Any, options: Any) -> None:
        self.engine = factory(options)

    def describe(self) -> dict[str, Any]:
        return {"features": self.engine.features, "version": self.engine.version, "pid": os.getpid()}

    async def setup(self) -> int:
        await self.engine.setup()
        return self.engine.version

    async def compute_logprobs(self, batch: Any, values: bool) -> Any:
        return await self.engine.compute_logprobs(batch, values=values)

    async def train_step(self, batch: Any, algorithm: Any) -> tuple[dict[str, float], int]:
        metrics = await self.engine.train_step(batch, algorithm)
        return dict(metrics), self.engine.version

    async def export_weights(self, bucket_bytes: int) -> list[WeightBucket]:
        return [b async for b in self.engine.export_weights(bucket_bytes=bucket_bytes)]

    async def save(self, path: str) -> None:
        await self.engine.save(Path(path))

    async def load(self, path: str) -> int:
        await self.engine.load(Path(path))
        return self.engine.version

    async def export_pretrained(self, path: str) -> None:
        await self.engine.export_pretrained(Path(path))

    async def health(self) -> bool:
        return True

    async def shutdown(self) -> None:
        await self.engine.shutdown()


class RewardActor:
    """Hosts one copy of the reward and scores whole batches (one round trip per batch, not per sample)."""

    def __init__(self, factory: Any, options: Any) -> None:
        self.reward = factory(options)

    def describe(self) -> dict[str, Any]:
        return {"needs_text": bool(getattr(self.reward, "needs_text", True)), "pid": os.getpid()}

    async def score_many(self, samples: list[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        """``(True, value)`` or ``(False, "why")`` per sample, like the reward stage's own per-sample loop."""
        out: list[tuple[bool, Any]] = []
        for sample in samples:
            try:
                value = self.reward.score(sample)
                if inspect.isawaitable(value):
                    value = await asyncio.wait_for(value, timeout_s)
                if isinstance(value, Mapping):
                    value = dict(value)
                out.append((True, value))
            except TimeoutError:
                out.append((False, f"timed out after {timeout_s}s"))
            except Exception as exc:  # noqa: BLE001 - one sample's failure is recorded, the others go on
                out.append((False, f"{type(exc).__name__}: {exc}"))
        return out

    async def health(self) -> bool:
        return True
