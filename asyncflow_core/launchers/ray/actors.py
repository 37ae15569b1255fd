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

from asyncflow_core.interfaces.features import reward_features
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

    Weights arrive as object-store references (``update_weights_refs``) or
    by broadcast in the run's dist weight group (``open_weight_group``,
    ``load_weights_dist``): see :mod:`.weights`.
    """

    def __init__(self, factory: Any, options: Any) -> None:
        from asyncflow_core.launchers.ray.weight_actors import WeightReceiver

        self.engine = factory(options)
        self.calls: dict[int, asyncio.Queue] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.weights = WeightReceiver(self.engine)

    def describe(self) -> dict[str, Any]:
        return {"features": self.engine.features, "version": self.engine.version, "pid": os.getpid()}

    def configure_adapter(self, spec: Any) -> None:
        """Forward ``RolloutEngine.configure_adapter`` (LoRA) to the engine, before :meth:`start`."""
        self.engine.configure_adapter(spec)

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

    async def update_weights_refs(self, version: int, refs: list[Any], kv_cache: Any,
                                  checksums: Sequence[str] | None = None) -> int:
        """Load a version whose buckets are in the object store (fetched one by one, in order).

        ``checksums`` (from the handles) must match what each fetched bucket
        says it holds, so a reference to the wrong object is refused; the
        engine then checks every buffer against its checksum.
        """
        from asyncflow_core.errors import WeightTransferError

        async def stream():
            for i, ref in enumerate(refs):
                bucket: WeightBucket = await ref
                if checksums is not None and bucket.checksum != checksums[i]:
                    raise WeightTransferError(f"bucket {i} of version {version} fetched from the object store is not "
                                              f"the one announced (checksum {bucket.checksum} != {checksums[i]})")
                yield bucket

        await self.engine.update_weights(version, stream(), kv_cache=kv_cache)
        return self.engine.version

    async def open_weight_group(self, port: int, world_size: int, rank: int, backend: str, join_timeout_s: float,
                                chunk_mb: float) -> None:
        """Join the run's dist weight group as ``rank`` (in the background: returns at once)."""
        await self.weights.open_group(port, world_size, rank, backend, join_timeout_s, chunk_mb)

    async def load_weights_dist(self, min_version: int, deadline_s: float, kv_cache: Any) -> int:
        """Load the newest version >= ``min_version`` received by broadcast; the engine's version after."""
        return await self.weights.load(min_version, deadline_s, kv_cache)

    async def close_weight_group(self) -> None:
        await self.weights.close_group()

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
    """Hosts the :class:`~asyncflow_core.interfaces.TrainEngine` (the engine's driver side).

    An engine that runs several ranks (``fsdp`` / ``megatron`` with
    ``world_size`` > 1) starts them through the process's rank spawner
    (:mod:`asyncflow_core.launchers.ranks`). With ``rank_spawner`` given (the
    launcher's ``trainer_ranks: actors``, a
    :class:`~asyncflow_core.launchers.ray.ranks.RayRankSpawner`) each rank is
    a Ray actor of its own, placed in the trainer's placement bundles, and
    torch.distributed is initialised inside those actors; this actor only
    plans, commands and gathers. Without it the ranks are this actor's child
    processes, as they would be the driver's under ``local``.
    """

    def __init__(self, factory: Any, options: Any, rank_spawner: Any = None) -> None:
        if rank_spawner is not None:
            from asyncflow_core.launchers.ranks import install_rank_spawner

            # process-wide: this actor's process hosts this one engine, which starts its ranks later, in setup()
            install_rank_spawner(rank_spawner)
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

    # -- weights that do not pass through the driver (launcher.options.weights; see .weights) --

    def _weight_sender(self) -> Any:
        sender = getattr(self, "_sender", None)
        if sender is None:
            from asyncflow_core.launchers.ray.weight_actors import WeightSender

            sender = self._sender = WeightSender(self.engine)
        return sender

    async def put_weights(self, bucket_bytes: int) -> list[Any]:
        """Export the current version into the object store; one handle (no bytes) per bucket."""
        return await self._weight_sender().put(bucket_bytes)

    async def open_weight_group(self, generation: int, world_size: int, backend: str, join_timeout_s: float,
                                chunk_mb: float) -> int:
        """Open rank 0 of the dist weight group on a free 127.0.0.1 port; returns the port for the receivers."""
        return await self._weight_sender().open_group(generation, world_size, backend, join_timeout_s, chunk_mb)

    async def send_weights(self, bucket_bytes: int, deadline_s: float) -> list[Any]:
        """Export and broadcast the current version to the group; one handle (no bytes) per bucket."""
        return await self._weight_sender().send(bucket_bytes, deadline_s)

    async def put_last_weights(self, min_version: int) -> list[Any]:
        """The last version broadcast, put in the object store for a replica outside the group."""
        return await self._weight_sender().put_last(min_version)

    async def close_weight_group(self) -> None:
        await self._weight_sender().close_group()

    async def abandon_weight_send(self, reason: str) -> bool:
        """Give up the broadcast in flight (a rank died): ``send_weights`` then fails with ``reason``."""
        return self._weight_sender().abandon(reason)


class RewardActor:
    """Hosts one copy of the reward and scores whole batches (one round trip per batch, not per sample)."""

    def __init__(self, factory: Any, options: Any) -> None:
        self.reward = factory(options)

    def describe(self) -> dict[str, Any]:
        features = reward_features(self.reward)
        return {"needs_text": features.needs_text, "extras": list(features.extras), "pid": os.getpid()}

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


class RewardModelActor:
    """Hosts one replica of a reward model (an instance of a served ``reward_model`` role; see
    :mod:`asyncflow_core.flow.roles`), built by its record's factory: it scores whole batches.

    The reward that uses it runs in the driver and reaches it through a
    :class:`~.remote.RemoteRewardModel`; the model is loaded here, once per
    actor, never in the driver or in a reward worker.
    """

    def __init__(self, factory: Any, options: Any) -> None:
        self.replica = factory(options)

    def describe(self) -> dict[str, Any]:
        """Its pid and the device its replica runs on (``str(replica.device)`` once loaded, when it has one)."""
        device = getattr(self.replica, "device", None)
        return {"pid": os.getpid(), "device": None if device is None else str(device),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    async def start(self) -> None:
        await self.replica.start()

    async def score_many(self, samples: list[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        return list(await self.replica.score_many(samples, timeout_s))

    async def health(self) -> bool:
        return True

    async def shutdown(self) -> None:
        await self.replica.shutdown()
