"""Weights under the ray launcher: seconds per version push, trainer actor → rollout actors, for each weight path.

    .venv/bin/python benchmarks/ray_weights.py [--json] [--sizes 1,64,256] [--replicas 1,2] [--repeats 5]
        [--modes driver,object_store,dist] [--bucket-mb 64]

On a loopback-only single-host Ray (``init_local_ray``: 127.0.0.1, no
dashboard), for each model size and number of rollout actors, one trainer
actor and N rollout actors are built with the launcher's own actor classes
and driver-side proxies (``TrainActor``/``RolloutActor``,
``RemoteTrainEngine``/``RemoteRolloutEngine``, ``RayWeights``). Their
engines are stand-ins defined here: the trainer holds the model as 4 MiB fp32
random tensors and exports each version with the project's bucket packer
(``pack_buckets``: one copy plus checksums, the same for every path); a
rollout engine verifies every bucket's checksum and keeps the buffers.

One push is what the flow runtime does per version: ``transport.send(
trainer.export_weights(...))``, then every replica's ``receive`` +
``update_weights`` concurrently; timed from the send until every replica has
loaded the version. One unmeasured push first (the dist group forms then).
Medians over ``--repeats``. "driver MB" is the driver process's peak resident
memory during a push above its level before it (sampled every 5 ms).

- ``driver``: the trainer's buckets come back to the driver, are staged by
  the ``inprocess`` transport and put into the object store by the rollout
  proxies (the path before ``launcher.options.weights``);
- ``object_store``: the trainer actor puts the buckets; the driver stages
  handles; each rollout actor fetches the objects;
- ``dist``: a gloo group on 127.0.0.1 of the trainer actor and the rollout
  actors; the driver stages handles and orders the loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncflow_core.interfaces import KVCachePolicy
from asyncflow_core.types import pack_buckets

ALL_MODES = ("driver", "object_store", "dist")
TENSOR_FLOATS = 1 << 20  # 4 MiB fp32 tensors
DEADLINE_S = 600.0


class BenchTrainer:
    """A trainer engine that only exports: a new version of the same random tensors on every export."""

    def __init__(self, size_mb: float) -> None:
        n = max(1, round(size_mb * (1 << 20) / (TENSOR_FLOATS * 4)))
        floats = TENSOR_FLOATS if size_mb >= 4 else max(1, int(size_mb * (1 << 20)) // 4)
        gen = torch.Generator().manual_seed(0)
        self.tensors = [(f"layers.{i}.weight", torch.randn(floats, generator=gen)) for i in range(n)]
        self.version = 0
        self.features = {"bench": True}

    async def setup(self) -> None:
        pass

    async def export_weights(self, *, bucket_bytes: int):
        self.version += 1
        for bucket in pack_buckets(self.tensors, version=self.version, bucket_bytes=bucket_bytes):
            yield bucket

    async def shutdown(self) -> None:
        pass


class BenchRollout:
    """A rollout engine that verifies every bucket and keeps the version's buffers, as a real engine loads them."""

    def __init__(self, _options: Any) -> None:
        self.version = 0
        self.features = {"bench": True}
        self.held: list[Any] = []

    async def start(self) -> None:
        pass

    async def update_weights(self, version: int, buckets: Any, *, kv_cache: Any = None) -> None:
        held = []
        async for b in buckets:
            b.verify()
            held.append(b.buffer)
        self.held, self.version = held, version

    async def health(self) -> bool:
        return True

    async def shutdown(self) -> None:
        self.held = []


class PeakRSS:
    """The driver's peak resident set while a push runs, sampled from /proc/self/statm."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self) -> Self:
        self.base = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def added_mb(self) -> float:
        return (self.peak - self.base) / (1 << 20)


async def measure(mode: str, size_mb: float, replicas: int, repeats: int, bucket_mb: float) -> dict[str, Any]:
    from asyncflow_core.launchers.ray.launcher import _RemoteRollout, _RemoteTrain
    from asyncflow_core.launchers.ray.remote import RemoteRolloutEngine, RemoteTrainEngine, WatchedActor
    from asyncflow_core.launchers.ray.weights import RayWeights
    from asyncflow_core.plugins import get_plugin_manager

    counters: Counter[str] = Counter()
    weights = RayWeights(mode, deadline_s=DEADLINE_S, counters=counters)  # type: ignore[arg-type]

    def watched(role: str, cls: Any, factory: Any, options: Any) -> WatchedActor:
        return WatchedActor(role, lambda: cls.options(num_cpus=0).remote(factory, options), heartbeat_s=30,
                            heartbeat_timeout_s=DEADLINE_S)

    trainer = RemoteTrainEngine(watched("trainer", _RemoteTrain, BenchTrainer, size_mb), deadline_s=DEADLINE_S,
                                weights=weights)
    rollouts = []
    cache: dict[Any, Any] = {}
    for i in range(replicas):
        r = RemoteRolloutEngine(watched(f"rollout/{i}", _RemoteRollout, BenchRollout, None), deadline_s=DEADLINE_S,
                                max_restarts=0, bucket_cache=cache, counters=counters, weights=weights)
        weights.add_replica(r)
        rollouts.append(r)
    transport = (get_plugin_manager().create("weight_transport", "inprocess", {}) if mode == "driver"
                 else weights.make_transport())
    try:
        await trainer.setup()
        await asyncio.gather(*(r.start() for r in rollouts))
        bucket_bytes = int(bucket_mb * (1 << 20))

        async def push() -> tuple[float, float, int]:
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                report = await transport.send(trainer.export_weights(bucket_bytes=bucket_bytes), deadline_s=DEADLINE_S)

                async def load(r: RemoteRolloutEngine) -> None:
                    stream = transport.receive(min_version=report.version, deadline_s=DEADLINE_S)
                    await r.update_weights(report.version, stream, kv_cache=KVCachePolicy.RECOMPUTE)

                await asyncio.gather(*(load(r) for r in rollouts))
                seconds = time.perf_counter() - t0
            if any(r.version != report.version for r in rollouts):
                raise RuntimeError(f"{mode}: replicas at {[r.version for r in rollouts]}, sent {report.version}")
            return seconds, mem.added_mb, report.bytes

        await push()  # warm-up: actors' first fetch, the dist group's rendezvous
        runs = [await push() for _ in range(repeats)]
    finally:
        await transport.close()
        for p in (trainer, *rollouts):
            await p.shutdown()
        del cache
    nbytes = runs[0][2]
    seconds = statistics.median(r[0] for r in runs)
    return {"mode": mode, "size_mb": round(nbytes / (1 << 20), 1), "replicas": replicas, "repeats": repeats,
            "median_s": round(seconds, 4), "min_s": round(min(r[0] for r in runs), 4),
            "gb_per_s": round(nbytes * replicas / seconds / 1e9, 3),
            "driver_mb": round(statistics.median(r[1] for r in runs), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    parser.add_argument("--sizes", default="1,64,256", help="Model sizes in MiB of fp32, comma-separated.")
    parser.add_argument("--replicas", default="1,2", help="Numbers of rollout actors, comma-separated.")
    parser.add_argument("--repeats", type=int, default=5, help="Measured pushes per case (median shown).")
    parser.add_argument("--modes", default=",".join(ALL_MODES), help="Weight paths to run.")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="weight_transport.bucket_mb of the export.")
    parser.add_argument("--num-cpus", type=int, default=4, help="Logical CPUs of the local Ray.")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(ALL_MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; pick from {', '.join(ALL_MODES)}")
    sizes = [float(s) for s in args.sizes.split(",") if s]
    replica_counts = [int(r) for r in args.replicas.split(",") if r]

    import ray

    from asyncflow_core.store.deployments.ray_store import init_local_ray

    init_local_ray(num_cpus=args.num_cpus)
    rows = []
    try:
        for size in sizes:
            for n in replica_counts:
                for mode in modes:
                    row = asyncio.run(measure(mode, size, n, args.repeats, args.bucket_mb))
                    rows.append(row)
                    if not args.json:
                        print(f"  {mode:>12} {row['size_mb']:>7} MB x{n}: {row['median_s']:.4f} s", file=sys.stderr)
    finally:
        ray.shutdown()
    report = {"host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                       "ray": ray.__version__}, "bucket_mb": args.bucket_mb, "results": rows}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{'model MB':>9} {'replicas':>8} {'path':>13} {'median s':>9} {'min s':>8} {'GB/s':>7} {'driver MB':>10}")
    for r in rows:
        print(f"{r['size_mb']:>9} {r['replicas']:>8} {r['mode']:>13} {r['median_s']:>9.4f} {r['min_s']:>8.4f} "
              f"{r['gb_per_s']:>7.3f} {r['driver_mb']:>10.1f}")
    best = {}
    for r in rows:
        key = (r["size_mb"], r["replicas"])
        if key not in best or r["median_s"] < best[key]["median_s"]:
            best[key] = r
    print("fastest: " + ", ".join(f"{k[0]} MB x{k[1]}: {v['mode']}" for k, v in best.items()))


if __name__ == "__main__":
    main()
