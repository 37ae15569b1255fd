"""Weight transport benchmark: seconds and GB/s to move an fp32 state dict from a sender to a receiver.

    PYTHONPATH=.:spec python benchmarks/transport_bench.py [--json] [--sizes 64,512] [--repeats 3]
        [--transports inprocess,shm,dist,disk] [--bucket-mb 32] [--disk-dir DIR]

The state dict is fp32 tensors of 4 MiB each, packed once into buckets of
``--bucket-mb`` (packing and the sender's checksums are the trainer's export,
not timed). One measurement is one version, from just before ``send`` until
the receiver holds every bucket *verified* (checksums recomputed on arrival):

- ``inprocess``: sender and receiver in this process (received by reference;
  the figure is the receiver's checksum pass);
- ``shm``, ``disk``: the receiver is a spawned process already waiting in
  ``receive``; the end time is taken there (``time.monotonic`` is one clock
  for every process of the host);
- ``dist``: a 2-rank gloo group (this process is the source, a spawned
  process the receiver); ``send`` returns once the receiver confirmed.

GB/s counts the payload once (10^9 bytes per GB). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

ALL_TRANSPORTS = ("inprocess", "shm", "dist", "disk")
TENSOR_FLOATS = 1 << 20  # 4 MiB fp32 tensors
DEADLINE_S = 600.0


def state_dict(mb: int) -> list[tuple[str, torch.Tensor]]:
    n = max(1, (mb << 20) // (TENSOR_FLOATS * 4))
    gen = torch.Generator().manual_seed(mb)
    return [(f"layers.{i}.weight", torch.randn(TENSOR_FLOATS, generator=gen)) for i in range(n)]


async def _aiter(items):
    for item in items:
        yield item


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(kind: str, *, rank: int, port: int, name: str, disk_dir: str) -> dict[str, Any]:
    if kind == "shm":
        return {"name": name}
    if kind == "dist":
        return {"rank": rank, "world_size": 2, "port": port, "join_timeout_s": 120}
    if kind == "disk":
        return {"path": disk_dir, "keep_last": 2}
    return {}


def _receiver(kind: str, options: dict[str, Any], versions: list[int], conn) -> None:
    """Spawned receiver: wait for each version, verify it (inside ``receive``), report when it was complete."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncflow_core.plugins import get_plugin_manager

    async def main() -> None:
        t = get_plugin_manager().create("weight_transport", kind, options)
        conn.send("ready")
        try:
            for v in versions:
                got = [b async for b in t.receive(min_version=v, deadline_s=DEADLINE_S)]
                conn.send((got[0].version, time.monotonic()))
                del got
            conn.recv()
        finally:
            await t.close()

    asyncio.run(main())


async def _measure(kind: str, sizes: list[int], repeats: int, bucket_mb: int, disk_dir: str) -> dict[int, list[float]]:
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import pack_buckets

    pm = get_plugin_manager()
    plan = [(mb, r) for mb in sizes for r in range(repeats)]
    versions = list(range(1, len(plan) + 1))
    port = _free_port()
    name = f"bench.{os.getpid()}"
    proc = conn = None
    if kind != "inprocess":
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(kind, _options(kind, rank=1, port=port, name=name,
                                                                   disk_dir=disk_dir), versions, child))
        proc.start()
    sender = pm.create("weight_transport", kind, _options(kind, rank=0, port=port, name=name, disk_dir=disk_dir))
    results: dict[int, list[float]] = {mb: [] for mb in sizes}
    try:
        if conn is not None:
            await asyncio.to_thread(conn.recv)  # the receiver is up (its transport opened)
        packed: dict[int, list] = {}
        for version, (mb, _) in zip(versions, plan, strict=True):
            if mb not in packed:
                packed.clear()
                packed[mb] = list(pack_buckets(state_dict(mb), version=0, bucket_bytes=bucket_mb << 20))
            buckets = [dataclasses.replace(b, version=version) for b in packed[mb]]
            start = time.monotonic()
            await sender.send(_aiter(buckets), deadline_s=DEADLINE_S)
            if conn is None:
                async for _bucket in sender.receive(min_version=version, deadline_s=DEADLINE_S):
                    pass
                end = time.monotonic()
            else:
                got_version, end = await asyncio.to_thread(conn.recv)
                assert got_version == version, (got_version, version)
            results[mb].append(end - start)
            del buckets
        if conn is not None:
            conn.send("close")
    finally:
        await sender.close()
        if proc is not None:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return results


def run_bench(transports: list[str], sizes: list[int], repeats: int, bucket_mb: int, disk_dir: str | None) -> dict:
    rows = []
    for kind in transports:
        with tempfile.TemporaryDirectory(prefix="asyncflow-bench-disk-", dir=disk_dir) as tmp:
            measured = asyncio.run(_measure(kind, sizes, repeats, bucket_mb, tmp))
        for mb in sizes:
            seconds = statistics.median(measured[mb])
            nbytes = mb << 20
            rows.append({"transport": kind, "mb": mb, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                         "all_seconds": measured[mb]})
    return {
        "benchmark": "transport_bench",
        "repeats": repeats,
        "bucket_mb": bucket_mb,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "results": rows,
    }


def print_table(report: dict) -> None:
    m = report["machine"]
    print(f"weight transports: fp32 state dict, buckets of {report['bucket_mb']} MiB, median of "
          f"{report['repeats']}; {m['cpus']} CPUs, torch {m['torch']}")
    print(f"{'transport':<10} {'size':>8} {'seconds':>9} {'GB/s':>7}")
    for row in report["results"]:
        print(f"{row['transport']:<10} {row['mb']:>5} MB {row['seconds']:>9.3f} {row['gb_per_s']:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    parser.add_argument("--sizes", default="64,512", help="State-dict sizes in MiB, comma-separated.")
    parser.add_argument("--repeats", type=int, default=3, help="Measurements per transport and size (median shown).")
    parser.add_argument("--transports", default=",".join(ALL_TRANSPORTS), help="Which transports to run.")
    parser.add_argument("--bucket-mb", type=int, default=32, help="Bucket size the state dict is packed into.")
    parser.add_argument("--disk-dir", default=None, help="Parent directory for the disk transport (default: $TMPDIR).")
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(ALL_TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports {sorted(unknown)}; choose from {ALL_TRANSPORTS}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    return emit(run_bench(transports, sizes, args.repeats, args.bucket_mb, args.disk_dir), args.json, print_table)


def emit(report: dict, as_json: bool, table) -> int:
    """Print ``report`` as one JSON object (``--json``) or as ``table(report)``; the exit status of a benchmark."""
    if as_json:
        print(json.dumps(report))
    else:
        table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
