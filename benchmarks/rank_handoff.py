"""A rank's weight bucket handed to the driver: copied out of shared memory (before) vs mapped (now).

Both sides in one process, one after the other, median of ``--repeats``; every
page of the result is read once, so mapping pays its page faults.

``--export`` measures the rank's whole hand-off of one version instead
(tensors of 64 MiB, ``--mib`` in all, in buckets of 64 MiB): ``fresh`` is
the code before kept segments (``pack_buckets`` into a private buffer, copied
into a new segment per bucket, mapped and unlinked by the driver), ``kept``
the code now (``RankWorkerBase.ship_buckets``: packed straight into
segments kept across versions, mapped by the driver under its lock). The
driver drops each version before the next export, after reading every page.

    .venv/bin/python benchmarks/rank_handoff.py [--mib 1024] [--repeats 3] [--json] [--export]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch

from asyncflow_core.launchers.rank_driver import from_shared_memory
from asyncflow_core.launchers.rank_worker import to_shared_memory


def copy_out(name: str, nbytes: int) -> torch.Tensor:
    """What the driver did before: copy the segment into a tensor it owns, then unlink it."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.numpy()[:] = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
    finally:
        shm.close()
        shm.unlink()
    return out


def measure(receive, buffer: torch.Tensor, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        name = to_shared_memory(buffer)
        t0 = time.perf_counter()
        got = receive(name, buffer.numel())
        int(got[::4096].sum())  # touch every page
        times.append(time.perf_counter() - t0)
        del got
        gc.collect()
    return times


def export_rows(mib: int, repeats: int) -> dict:
    """One version's hand-off from a rank, fresh segments (before) vs kept ones (now), alternating."""
    from asyncflow_core.launchers.rank_worker import RankWorkerBase
    from asyncflow_core.types import pack_buckets

    class Worker(RankWorkerBase):
        pass

    tensors = [(f"w{i}", torch.randn(16 << 20)) for i in range(max(1, mib // 64))]
    payload = {"version": 1, "bucket_bytes": 64 << 20, "index": 0}

    def fresh() -> list[torch.Tensor]:
        out = []
        for b in pack_buckets(tensors, version=1, bucket_bytes=64 << 20):
            out.append(from_shared_memory(to_shared_memory(b.buffer), b.nbytes, kept=False))
        return out

    worker = Worker(0, 1, None)

    def kept() -> list[torch.Tensor]:
        return [from_shared_memory(d["shm"], d["nbytes"], kept=d["kept"])
                for d in worker.ship_buckets(tensors, payload)]

    times: dict[str, list[float]] = {"fresh segments (before)": [], "kept segments (now)": []}
    try:
        for r in range(repeats + 1):  # the first round is a warm-up (kept segments are created then)
            order = list(times.items()) if r % 2 == 0 else list(reversed(times.items()))
            for label, samples in order:
                fn = fresh if label.startswith("fresh") else kept
                t0 = time.perf_counter()
                got = fn()
                for g in got:
                    int(g[::4096].sum())  # the driver reads every page
                if r:
                    samples.append(time.perf_counter() - t0)
                del got
                gc.collect()
    finally:
        worker.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    rows = {label: {"median_s": statistics.median(v), "gb_per_s": nbytes / statistics.median(v) / 1e9,
                    "all_s": v} for label, v in times.items()}
    return {"mib": nbytes >> 20, "repeats": repeats, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--export", action="store_true", help="A whole export's hand-off: fresh vs kept segments.")
    args = ap.parse_args()
    if args.export:
        result = export_rows(args.mib, args.repeats)
        if args.json:
            print(json.dumps(result))
            return
        print(f"| export of {result['mib']} MiB, rank to driver | median s | GB/s | every s |\n|---|---|---|---|")
        for label, r in result["rows"].items():
            every = " ".join(f"{x:.3f}" for x in r["all_s"])
            print(f"| {label} | {r['median_s']:.3f} | {r['gb_per_s']:.2f} | {every} |")
        return
    buffer = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    rows = {}
    for label, fn in (("copy out (before)", copy_out), ("map (now)", from_shared_memory)):
        times = measure(fn, buffer, args.repeats)
        rows[label] = {"median_s": statistics.median(times), "gb_per_s": buffer.numel() / statistics.median(times) / 1e9}
    result = {"mib": args.mib, "repeats": args.repeats, "rows": rows,
              "speedup": rows["copy out (before)"]["median_s"] / rows["map (now)"]["median_s"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"| hand-off of {args.mib} MiB | median s | GB/s |\n|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['median_s']:.3f} | {r['gb_per_s']:.1f} |")
    print(f"speed-up: {result['speedup']:.1f}x")


if __name__ == "__main__":
    main()
