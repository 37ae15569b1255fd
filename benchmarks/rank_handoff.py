"""A rank's weight bucket handed to the driver: copied out of shared memory (before) vs mapped (now).

Both sides in one process, one after the other, median of ``--repeats``; every
page of the result is read once, so mapping pays its page faults.

    .venv/bin/python benchmarks/rank_handoff.py [--mib 1024] [--repeats 3] [--json]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
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
