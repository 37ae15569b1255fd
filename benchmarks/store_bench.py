"""Streaming store benchmark: put+get throughput, get_meta latency and loop rows/s per deployment.

    PYTHONPATH=.:spec python benchmarks/store_bench.py [--quick] [--json]
        [--deployments inprocess,multiprocess,ray] [--sizes 1,16,128] [--repeats 5] [--warmup ROUNDS]

A batch is what one RL step writes: rows of ragged int64 token ids plus
float32 per-token log-probs (1024 tokens per row, 12 bytes per token).
"put+get" is one ``put`` then ``get_meta`` + ``get`` + ``ack`` of the same
rows; GB/s counts the batch's bytes once over that whole loop. The physical
reference is a plain torch copy of the same bytes (``memcpy_gbps``: into a
preallocated buffer; the table also shows a copy into fresh memory,
``clone``). Ray's object store peer is ``ray.get(ray.put(tensors))``.
Medians over ``--repeats``, after ``--warmup`` rounds that are not counted
(default: 16 MB worth of batches, at least one: a 1 MB loop runs 1.5-3x its
steady time for its first ten rounds here, while caches and the core's clock
warm up). Deployments not implemented in this tree are
listed as such, never estimated.

``--fixed-cost N`` adds the in-process store's per-call fixed cost: the same
loop over the same number of rows as the 1 MB batch, each row one token
long, ``N`` times; the calling thread's CPU time (``time.thread_time``) per
call, which in-process is all of the store's work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

TOKENS_PER_ROW = 1024
BYTES_PER_TOKEN = 12  # int64 id + float32 log-prob
ALL_DEPLOYMENTS = ("inprocess", "multiprocess", "distributed", "ray")


def make_batch(batch_mb: int) -> dict[str, Any]:
    from asyncflow_core.types import RaggedTensor

    rows = max(1, (batch_mb << 20) // (TOKENS_PER_ROW * BYTES_PER_TOKEN))
    n = rows * TOKENS_PER_ROW
    lengths = torch.full((rows,), TOKENS_PER_ROW, dtype=torch.int64)
    ids = RaggedTensor.from_lengths(torch.randint(0, 50000, (n,), dtype=torch.int64), lengths)
    lp = RaggedTensor.from_lengths(torch.randn(n, dtype=torch.float32), lengths)
    return {"response_ids": ids, "logprobs": lp}


def batch_bytes(batch: dict[str, Any]) -> int:
    return sum(c.values.numel() * c.values.element_size() for c in batch.values())


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def memcpy_gbps(batch: dict[str, Any], repeats: int) -> tuple[float, float]:
    """(copy into a preallocated buffer, copy into fresh memory) in GB/s, medians."""
    srcs = [c.values for c in batch.values()]
    dsts = [torch.empty_like(s) for s in srcs]
    nbytes = batch_bytes(batch)
    warm, fresh = [], []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)
        warm.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        out = [s.clone() for s in srcs]
        fresh.append(nbytes / (time.perf_counter() - t) / 1e9)
        del out
    return median(warm[1:]), median(fresh[1:])


# ------------------------------------------------------------------ stores


async def open_store(deployment: str, capacity: int, arena_mb: int):
    if deployment == "inprocess":
        from asyncflow_core.store.inprocess import InProcessStore, InProcessStoreConfig

        return InProcessStore(InProcessStoreConfig(capacity=capacity))
    if deployment == "multiprocess":
        from asyncflow_core.store.controller import Controller
        from asyncflow_core.store.deployments.multiprocess import MultiprocessStore

        return MultiprocessStore.serve(arena_mb=arena_mb, controller=Controller(capacity))
    if deployment == "distributed":
        from asyncflow_core.store.deployments.config import DistributedStoreConfig
        from asyncflow_core.store.deployments.distributed import DistributedStore

        _join_distributed_world()  # this process is rank 1; rank 0 (a spawned process) hosts the store
        return DistributedStore(DistributedStoreConfig(name=None, capacity=capacity, arena_mb=arena_mb))
    if deployment == "ray":
        from asyncflow_core.store.deployments.ray_store import RayStore, init_local_ray

        init_local_ray()  # loopback-only; left running for the later figures (and the object-store peer)
        return RayStore(capacity=capacity)
    raise NotImplementedError(f"the {deployment} deployment is not implemented in this tree")


_DIST_WORLD: list[Any] = []


def _serve_rank0(port: int, conn: Any) -> None:
    """The distributed store's server rank: hosts the store until the benchmark process says stop."""
    import torch.distributed as dist

    from asyncflow_core.store.deployments.distributed import DistributedHost, init_loopback_process_group

    init_loopback_process_group(0, 2, port)
    host = DistributedHost.start()
    conn.send("ready")
    try:
        conn.recv()
    except EOFError:
        pass
    host.stop()
    dist.destroy_process_group()


def _join_distributed_world() -> None:
    """Spawn the server rank once and join its 2-rank gloo group (loopback only) as rank 1."""
    if _DIST_WORLD:
        return
    import atexit
    import multiprocessing as mp
    import socket

    import torch.distributed as dist

    from asyncflow_core.store.deployments.distributed import init_loopback_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_rank0, args=(port, child), daemon=True)
    proc.start()
    init_loopback_process_group(1, 2, port)
    assert parent.poll(120) and parent.recv() == "ready", "the distributed store's server rank did not start"
    _DIST_WORLD.extend([proc, parent])

    def stop() -> None:
        parent.send("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        dist.destroy_process_group()

    atexit.register(stop)


def warmup_rounds(batch_mb: int, warmup: int | None) -> int:
    """Uncounted rounds before a throughput figure: ``warmup``, or 16 MB worth of batches (at least one)."""
    return max(1, 16 // max(1, batch_mb)) if warmup is None else warmup


async def throughput(deployment: str, batch_mb: int, repeats: int, warmup: int | None = None) -> dict[str, Any]:
    batch = make_batch(batch_mb)
    nbytes = batch_bytes(batch)
    rows = len(batch["response_ids"])
    store = await open_store(deployment, capacity=1 << 20, arena_mb=max(64, 3 * batch_mb))
    try:
        await store.register_task("rollout", produces=list(batch))
        await store.register_task("train", consumes=list(batch))
        times = []
        skip = warmup_rounds(batch_mb, warmup)
        for i in range(skip + repeats):  # the warm-up rounds warm pages and caches, and are not counted
            t = time.perf_counter()
            await store.put(batch)
            meta = await store.get_meta("train", list(batch), rows, timeout=60)
            got = await store.get(meta)
            await store.ack(meta)
            dt = time.perf_counter() - t
            del got
            if i >= skip:
                times.append(dt)
        dt = median(times)
        return {"deployment": deployment, "batch_mb": batch_mb, "gbps": nbytes / dt / 1e9, "rows_per_s": rows / dt,
                "ms_per_loop": dt * 1e3, "warmup": skip}
    finally:
        await store.close()


async def get_meta_latency(deployment: str, table_rows: int, samples: int) -> dict[str, Any]:
    store = await open_store(deployment, capacity=table_rows + 1024, arena_mb=64)
    try:
        await store.register_task("rollout", produces=["reward"])
        await store.register_task("train", consumes=["reward"])
        chunk = 65536
        for start in range(0, table_rows, chunk):
            await store.put({"reward": torch.zeros(min(chunk, table_rows - start), dtype=torch.float32)})
        lat = []
        for i in range(samples + 5):
            t = time.perf_counter()
            meta = await store.get_meta("train", ["reward"], 256, timeout=60)
            dt = time.perf_counter() - t
            await store.release(meta)
            if i >= 5:
                lat.append(dt * 1e3)
        lat.sort()
        return {"deployment": deployment, "table_rows": table_rows, "p50_ms": lat[len(lat) // 2],
                "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}
    finally:
        await store.close()


def ray_object_store(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """``ray.get(ray.put(tensors))`` of the same batches, on a loopback-only local Ray."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # makes Ray pick 127.0.0.1 for its node
    try:
        import ray
    except ImportError:
        return []
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="ERROR", ignore_reinit_error=True)  # the ray deployment may have started it
    out = []
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1", "Ray must bind to loopback only"
        for mb in sizes:
            batch = make_batch(mb)
            tensors = {k: (c.values, c.offsets) for k, c in batch.items()}
            nbytes = batch_bytes(batch)
            times = []
            for i in range(repeats + 1):
                t = time.perf_counter()
                got = ray.get(ray.put(tensors))
                dt = time.perf_counter() - t
                del got
                if i:
                    times.append(dt)
            dt = median(times)
            out.append({"batch_mb": mb, "gbps": nbytes / dt / 1e9, "rows_per_s": len(batch["response_ids"]) / dt})
    finally:
        ray.shutdown()
    return out


# ------------------------------------------------------------------ report


async def fixed_cost(loops: int) -> dict[str, Any]:
    """Thread CPU µs per put / get_meta / get / ack of the 1 MB batch's rows, one token each (no copy to speak of)."""
    from asyncflow_core.types import RaggedTensor

    full = make_batch(1)
    rows = len(full["response_ids"])
    one = torch.ones(rows, dtype=torch.int64)
    batch = {name: RaggedTensor.from_lengths(col.values[:rows].clone(), one) for name, col in full.items()}
    store = await open_store("inprocess", capacity=1 << 20, arena_mb=64)
    spent = dict.fromkeys(("put", "get_meta", "get", "ack"), 0.0)
    try:
        await store.register_task("rollout", produces=list(batch))
        await store.register_task("train", consumes=list(batch))
        for i in range(loops + 50):  # 50 warm-up loops, not counted
            t0 = time.thread_time()
            await store.put(batch)
            t1 = time.thread_time()
            meta = await store.get_meta("train", list(batch), rows, timeout=60)
            t2 = time.thread_time()
            got = await store.get(meta)
            t3 = time.thread_time()
            await store.ack(meta)
            t4 = time.thread_time()
            del got
            if i >= 50:
                for name, a, b in (("put", t0, t1), ("get_meta", t1, t2), ("get", t2, t3), ("ack", t3, t4)):
                    spent[name] += b - a
    finally:
        await store.close()
    per_call = {name: v / loops * 1e6 for name, v in spent.items()}
    return {"deployment": "inprocess", "rows": rows, "loops": loops, "us_per_call": per_call,
            "us_per_loop": sum(per_call.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deployments", default=",".join(ALL_DEPLOYMENTS), help="comma-separated deployments to measure")
    p.add_argument("--sizes", default="1,16,128", help="batch sizes in MB, comma-separated")
    p.add_argument("--table-rows", default="10000,100000,1000000", help="rows in the table for get_meta latency")
    p.add_argument("--repeats", type=int, default=5, help="measured repeats per figure (median reported)")
    p.add_argument("--warmup", type=int, default=None, metavar="ROUNDS",
                   help="uncounted put+get rounds before each throughput figure (default: 16 MB worth, at least 1)")
    p.add_argument("--no-ray-peer", action="store_true", help="skip Ray's object store peer")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of a table")
    p.add_argument("--fixed-cost", type=int, default=0, metavar="LOOPS",
                   help="also measure the in-process store's per-call fixed cost over LOOPS loops of 1-token rows")
    a = p.parse_args(argv)
    deployments = [d for d in a.deployments.split(",") if d]
    sizes = [int(s) for s in a.sizes.split(",") if s]
    table_rows = [int(s) for s in a.table_rows.split(",") if s]
    repeats, samples = a.repeats, 200
    if a.quick:
        sizes, table_rows, repeats, samples = [1, 16], [10000], 2, 50

    results, latencies, skipped = [], [], {}
    for dep in deployments:
        try:
            for mb in sizes:
                results.append(asyncio.run(throughput(dep, mb, repeats, a.warmup)))
            for n in table_rows:
                latencies.append(asyncio.run(get_meta_latency(dep, n, samples)))
        except NotImplementedError as exc:
            skipped[dep] = str(exc)
    warm, fresh = memcpy_gbps(make_batch(max(sizes)), repeats)
    ray_peer = [] if a.no_ray_peer else ray_object_store(sizes, repeats)
    ray_big = [r["gbps"] for r in ray_peer if r["batch_mb"] == max(sizes)]
    report = {
        "results": results,
        "get_meta": latencies,
        "memcpy_gbps": warm,
        "memcpy_fresh_gbps": fresh,
        "ray_gbps": ray_big[0] if ray_big else None,
        "ray_object_store": ray_peer,
        "not_measured": skipped,
        "fixed_cost": asyncio.run(fixed_cost(a.fixed_cost)) if a.fixed_cost > 0 else None,
        "batch": {"tokens_per_row": TOKENS_PER_ROW, "bytes_per_token": BYTES_PER_TOKEN},
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    if a.json:
        print(json.dumps(report))
        return 0
    _print_table(report)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # noqa: N806
    rows = [(x["deployment"], f'{x["batch_mb"]}', f'{x["gbps"]:.2f}', f'{x["rows_per_s"]:.0f}') for x in r["results"]]
    rows += [("ray object store", f'{x["batch_mb"]}', f'{x["gbps"]:.2f}', f'{x["rows_per_s"]:.0f}')
             for x in r["ray_object_store"]]
    lat = [(x["deployment"], f'{x["table_rows"]}', f'{x["p50_ms"]:.3f}', f'{x["p99_ms"]:.3f}') for x in r["get_meta"]]
    if Console is not None:
        c = Console()
        t = Table(title="put+get throughput (batch = ragged int64 ids + float32 log-probs)")
        for h in ("deployment", "batch MB", "GB/s", "rows/s"):
            t.add_column(h)
        for row in rows:
            t.add_row(*row)
        c.print(t)
        t = Table(title="get_meta latency (batch 256)")
        for h in ("deployment", "table rows", "p50 ms", "p99 ms"):
            t.add_column(h)
        for row in lat:
            t.add_row(*row)
        c.print(t)
    else:
        for row in rows + lat:
            print(" | ".join(row))
    print(f'memcpy (preallocated) {r["memcpy_gbps"]:.2f} GB/s; copy into fresh memory {r["memcpy_fresh_gbps"]:.2f} GB/s')
    if r["fixed_cost"] is not None:
        f = r["fixed_cost"]
        calls = ", ".join(f"{name} {us:.0f}" for name, us in f["us_per_call"].items())
        print(f'in-process fixed cost ({f["rows"]} rows of 1 token): {calls} µs thread CPU; {f["us_per_loop"]:.0f} per loop')
    for dep, why in r["not_measured"].items():
        print(f"not measured: {dep}: {why}")


if __name__ == "__main__":
    sys.exit(main())
