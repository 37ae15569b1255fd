"""CPU per step of the driver's threads and of its child processes over the steady steps of a real run.

Usage: python benchmarks/driver_cpu.py [--config examples/arithmetic_grpo.yaml] [--steps N] [--warmup W]
                                       [--json] [override ...]

One real run of the config (``trainer.total_steps = N``, no checkpoints, no
final export, dotted ``key=value`` overrides applied on top) in this process,
its run directory in a temporary directory removed afterwards. A sampler
thread polls the run's ``metrics.jsonl`` every 10 ms (nothing in the runtime
is patched) and reads ``/proc`` twice: when ``W`` steps are recorded and when
``N - 2`` are (a run's first steps warm up, its last has nothing generated
beside it). Between the two reads, per step:

- each thread of this process (the driver): user + system CPU from
  ``/proc/self/task/TID/stat``, grouped by thread name with a pool's worker
  index dropped (``ThreadPoolExecutor-0_3`` counts under
  ``ThreadPoolExecutor-0``); ``MainThread`` runs the event loop. Threads
  that start and end between the two reads are missed; the ``driver`` total
  (``/proc/self/stat``) counts them, and includes the sampler's own CPU,
  which is listed apart (``driver_cpu-sampler``);
- the child processes: every descendant of this process (the ``fsdp``
  rank, the forkserver, ...), found by walking ``/proc/*/stat`` parent ids,
  CPU summed over the tree (a process that exits before the second read is
  missed);
- the driver's garbage-collection pauses (``gc.callbacks``), wall time.

No profiler: the figures are the kernel's tick counts (``SC_CLK_TCK``, 10 ms
on most kernels), so a thread under ~1 ms a step reads as noise over a
short window; use ``--steps 60 --warmup 10`` or more for figures to quote.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from profile_step import _children_of, _cpu_s  # noqa: E402  (the /proc readers the profile uses)

SAMPLER = "driver_cpu-sampler"


def _thread_cpu() -> dict[int, float]:
    """User + system CPU seconds of each live thread of this process (``/proc/self/task/TID/stat``)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        cpu = _cpu_s(f"self/task/{tid}")
        if cpu is not None:
            out[int(tid)] = cpu
    return out


def _thread_names() -> dict[int, str]:
    """Thread id -> Python thread name (kernel ``comm`` for threads Python did not start)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in names:
            try:
                names[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
    return names


def _group(name: str) -> str:
    """A thread's group: its name without a pool's worker index or the ``(target)`` suffix Python adds."""
    return re.sub(r"_\d+$", "", name.split(" ")[0])


class _Snapshot:
    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.wall = time.perf_counter()
        self.threads = _thread_cpu()
        self.names = _thread_names()
        self.driver = _cpu_s("self") or 0.0
        self.children = {pid: c for pid in _children_of(os.getpid()) if (c := _cpu_s(pid)) is not None}


class _Sampler(threading.Thread):
    """Polls ``metrics.jsonl`` and takes a :class:`_Snapshot` at ``warmup`` and at ``end`` recorded steps."""

    def __init__(self, metrics: Path, warmup: int, end: int) -> None:
        super().__init__(name=SAMPLER, daemon=True)
        self.metrics, self.warmup, self.end = metrics, warmup, end
        self.snaps: list[_Snapshot] = []
        self.stop = threading.Event()
        self.gc_s = 0.0
        self.gc_counts = [0, 0, 0]
        self._gc_start: float | None = None

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None and len(self.snaps) == 1:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_counts[info["generation"]] += 1

    def run(self) -> None:
        lines = 0
        offset = 0
        while not self.stop.wait(0.01):
            try:
                if os.stat(self.metrics).st_size == offset:  # nothing new: no open, no read
                    continue
                with open(self.metrics, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            done = chunk.rfind(b"\n") + 1  # whole lines only: a record being written is counted next time
            lines += chunk.count(b"\n", 0, done)
            offset += done
            if not self.snaps and lines >= self.warmup:
                self.snaps.append(_Snapshot(lines))
            if len(self.snaps) == 1 and lines >= self.end:
                self.snaps.append(_Snapshot(lines))
                return


def measure(config: Path, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
    """Run ``config`` for ``steps`` steps and report the CPU per step over steps ``warmup`` .. ``steps - 2``."""
    from asyncflow_core.config.loader import load_config, resolve
    from asyncflow_core.flow.launcher import launch

    cfg = load_config(config, [*overrides, f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
                               "trainer.export_final=false"])
    with tempfile.TemporaryDirectory(prefix="driver_cpu-") as tmp:
        run_dir = Path(tmp) / "run"
        sampler = _Sampler(run_dir / "metrics.jsonl", warmup, steps - 2)
        gc.callbacks.append(sampler.on_gc)
        sampler.start()
        try:
            launch(resolve(cfg), run_dir=run_dir)
        finally:
            sampler.stop.set()
            sampler.join()
            gc.callbacks.remove(sampler.on_gc)
    if len(sampler.snaps) < 2:
        raise RuntimeError(f"the run recorded fewer than {steps - 2} steps in metrics.jsonl; nothing measured")
    a, b = sampler.snaps
    k = b.steps - a.steps
    names = {**a.names, **b.names}
    threads: dict[str, float] = {}
    counts: dict[str, int] = {}
    for tid, cpu in b.threads.items():
        group = _group(names.get(tid, str(tid)))
        threads[group] = threads.get(group, 0.0) + cpu - a.threads.get(tid, 0.0)
        counts[group] = counts.get(group, 0) + 1
    children = sum(cpu - a.children.get(pid, 0.0) for pid, cpu in b.children.items())
    ms = 1000.0 / k
    return {
        "config": str(config), "steps": steps, "warmup": warmup, "steps_measured": k,
        "window": [a.steps, b.steps],
        "wall_ms_per_step": (b.wall - a.wall) * ms,
        "driver_cpu_ms_per_step": (b.driver - a.driver) * ms,
        "threads_cpu_ms_per_step": {g: threads[g] * ms for g in sorted(threads, key=lambda g: -threads[g])},
        "threads_count": counts,
        "children_cpu_ms_per_step": children * ms,
        "children": len(b.children),
        "gc_ms_per_step": sampler.gc_s * ms, "gc_collections": sampler.gc_counts,
        "clock_ticks_per_s": os.sysconf("SC_CLK_TCK"),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "examples" / "arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=60, help="trainer.total_steps (N); measured: steps W..N-2")
    p.add_argument("--warmup", type=int, default=10, help="steps recorded before the window opens (W)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (key=value)")
    a = p.parse_args(argv)
    if not sys.platform.startswith("linux") or not Path("/proc/self/task").is_dir():
        print(f"driver_cpu.py reads /proc (Linux only); this is {sys.platform}: run it on Linux", file=sys.stderr)
        return 2
    if a.warmup < 1 or a.steps - 2 <= a.warmup:
        p.error(f"--steps {a.steps} --warmup {a.warmup}: need --warmup >= 1 and --steps >= --warmup + 3 "
                "(the window is steps W..N-2)")
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    from asyncflow_core.errors import ConfigError, PluginError

    try:
        res = measure(a.config, a.steps, a.warmup, a.overrides)
    except (ConfigError, PluginError, RuntimeError) as e:
        print(f"driver_cpu.py: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(res))
        return 0
    w0, w1 = res["window"]
    print(f"{res['config']}: steps {w0}..{w1} ({res['steps_measured']} measured), "
          f"wall {res['wall_ms_per_step']:.1f} ms a step, load {' '.join(res['loadavg'])}")
    print("what | threads | CPU ms per step")
    print("--- | --- | ---")
    for g, v in res["threads_cpu_ms_per_step"].items():
        print(f"{g} | {res['threads_count'][g]} | {v:.1f}")
    print(f"driver (all threads) | - | {res['driver_cpu_ms_per_step']:.1f}")
    print(f"children ({res['children']} processes) | - | {res['children_cpu_ms_per_step']:.1f}")
    print(f"driver gc pauses (wall; collections {res['gc_collections']}) | - | {res['gc_ms_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
