"""Simulated scaling: sync vs streaming vs delayed-update modes at 32-1,024 devices, on the virtual clock.

Usage: python benchmarks/sim_scaling.py [--devices 32,128,512,1024] [--modes sync,stream,one_step,async2,async4]
                                        [--steps 6] [--samples-per-device 64] [--json]

Every run is the real flow runtime and the real in-process store driving the
``sim`` engines (docs/simulation.md) on the virtual-clock loop.

Workload (the "long-tail default"): a 7B model, GRPO with n = 8 samples per
prompt, 512-token prompts, lognormal response lengths (median 1.5k, p99 ~12k,
capped at 8k), ``--samples-per-device`` samples per device per step
(B = samples_per_device x devices / n prompts per step).

Placement:
- ``sync``: colocated. Every device serves rollout, then every device
  trains (rollout engines sleep during the step and wake after): k = 0.
- ``stream`` (task-separated streaming, k = 0), ``one_step`` (k = 1),
  ``async2``/``async4`` (k = 2/4): the devices are split into a trainer group
  and rollout replicas (one device each). The split balances the modelled
  per-step cost of each side (whole 8-device nodes for the trainer).

``ideal``: rollout and training perfectly overlapped on the split —
samples per step / max(rollout seconds, train seconds) per step, where the
rollout seconds are the replicas' mean busy time per step and the train
seconds the trainer's busy time per step, both measured in the ``one_step``
run at that size. ``efficiency_vs_ideal`` = samples_per_s / ideal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.config.loader import resolve  # noqa: E402
from asyncflow_core.config.models import RunConfig  # noqa: E402
from asyncflow_core.flow.runtime import run_flow  # noqa: E402
from asyncflow_plugins.sim.latency import ResponseLengths, RolloutLatency, TrainLatency  # noqa: E402

N = 8
PROMPT_TOKENS = 512
MAX_NEW = 8192
MODES = {"sync": ("sync", 0), "stream": ("sync", 0), "one_step": ("one_step", 1), "async2": ("async", 2),
         "async4": ("async", 4)}


def expected_response_tokens(lengths: ResponseLengths, cap: int) -> float:
    """Mean of min(length, cap) by numeric integration of the lognormal quantile."""
    k = 2000
    return sum(min(lengths.quantile((i + 0.5) / k), cap) for i in range(k)) / k


def split(devices: int, samples: int) -> tuple[int, int]:
    """(rollout devices, trainer devices): trainer in whole nodes, balancing modelled per-step seconds."""
    roll, lengths = RolloutLatency(), ResponseLengths()
    resp = expected_response_tokens(lengths, MAX_NEW)
    best = None
    for t_nodes in range(1, devices // 8):
        dt = 8 * t_nodes
        dr = devices - dt
        per_replica = samples / dr
        batch = max(1, min(roll.max_running_seqs, int(per_replica)))
        rollout_s = per_replica * resp / roll.decode_throughput(batch)
        train_s = TrainLatency(devices=dt).train_time(int(samples * (PROMPT_TOKENS + resp)))
        cost = max(rollout_s, train_s)
        if best is None or cost < best[0]:
            best = (cost, dr, dt)
    assert best is not None
    return best[1], best[2]


def config(devices: int, mode: str, steps: int, samples_per_device: int) -> RunConfig:
    async_mode, k = MODES[mode]
    samples = samples_per_device * devices
    prompts = samples // N
    if mode == "sync":
        replicas, trainer_devices = devices, devices
    else:
        replicas, trainer_devices = split(devices, samples)
    data = {
        "name": f"sim-{devices}-{mode}",
        "data": {"name": "sim", "options": {"size": prompts * (steps + k + 2), "prompt_tokens": PROMPT_TOKENS},
                 "prompts_per_step": prompts, "shuffle": False},
        "rollout": {"name": "sim", "replicas": replicas, "n": N, "max_new_tokens": MAX_NEW, "max_inflight": 256,
                    "rows_per_lease": 256, "kv_cache": "keep"},
        "trainer": {"name": "sim", "options": {"latency": {"devices": trainer_devices}}, "total_steps": steps},
        "store": {"name": "inprocess", "options": {"capacity": max(65536, (k + 3) * samples)}},
        "weight_transport": {"name": "sim"},
        "algorithm": {"name": "grpo", "options": {"group_size": N}},
        "reward": {"name": "sim", "workers": 1},
        "pipeline": {"reward_batch": 1024, "write_interval_s": 0.5},
        "async": {"mode": async_mode, "colocated": mode == "sync",
                  **({"max_staleness": k} if async_mode == "async" else {})},
        "logging": {"level": "WARNING"},
    }
    return RunConfig.model_validate(data)


def run_one(devices: int, mode: str, steps: int, samples_per_device: int) -> dict[str, Any]:
    cfg = config(devices, mode, steps, samples_per_device)
    t0 = time.perf_counter()
    s = run_flow(resolve(cfg), virtual=True, write_png=False)
    wall = time.perf_counter() - t0
    util = s["utilisation"]
    rollout_busy = [v for lane, v in util.items() if lane.startswith("rollout/")]
    return {
        "devices": devices,
        "mode": mode,
        "max_staleness": MODES[mode][1],
        "rollout_replicas": cfg.rollout.replicas,
        "trainer_devices": cfg.trainer.options["latency"]["devices"],
        "samples_per_s": s["samples_per_s"],
        "sim_seconds": s["run_seconds"],
        "steps": s["steps"],
        "samples_trained": s["samples_trained"],
        "staleness_histogram": s["staleness_histogram"],
        "violations": sum(v for lag, v in s["staleness_histogram"].items() if int(lag) > MODES[mode][1]),
        "requeued": sum(v for k, v in s["ledger"].items() if k.startswith("requeued")),
        "dropped": s["ledger"]["dropped"],
        "rollout_busy_s_per_step": (sum(rollout_busy) / max(1, len(rollout_busy))) * s["run_seconds"] / s["steps"],
        "train_busy_s_per_step": util.get("train", 0.0) * s["run_seconds"] / s["steps"],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="32,128,512,1024")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples-per-device", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    results: list[dict[str, Any]] = []
    for devices in [int(d) for d in a.devices.split(",") if d]:
        if devices < 16 or devices % 8:
            p.error(f"--devices {devices}: use multiples of 8, at least 16 (the trainer takes whole 8-device nodes)")
        rows = [run_one(devices, m, a.steps, a.samples_per_device) for m in modes]
        by = {r["mode"]: r for r in rows}
        ref = by.get("one_step") or run_one(devices, "one_step", a.steps, a.samples_per_device)
        samples_per_step = a.samples_per_device * devices
        ideal = samples_per_step / max(ref["rollout_busy_s_per_step"], ref["train_busy_s_per_step"])
        base = by.get("sync")
        for r in rows:
            r["ideal_samples_per_s"] = ideal
            r["efficiency_vs_ideal"] = r["samples_per_s"] / ideal
            r["speedup_vs_sync"] = r["samples_per_s"] / base["samples_per_s"] if base else math.nan
        results.extend(rows)
        if not a.json:
            print(f"... {devices} devices done", file=sys.stderr)
    out = {"results": results, "steps": a.steps, "samples_per_device": a.samples_per_device, "n": N,
           "max_new_tokens": MAX_NEW}
    if a.json:
        print(json.dumps(out))
    else:
        _table(out)
    return 0


def _table(out: dict[str, Any]) -> None:
    head = ("devices", "mode", "k", "roll/train dev", "samples/s", "vs sync", "vs ideal", "stale>k", "requeued",
            "wall s")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in out["results"]:
        print(" | ".join(str(x) for x in (
            r["devices"], r["mode"], r["max_staleness"], f'{r["rollout_replicas"]}/{r["trainer_devices"]}',
            f'{r["samples_per_s"]:.2f}', f'{r["speedup_vs_sync"]:.2f}x', f'{r["efficiency_vs_ideal"]:.2f}',
            r["violations"], r["requeued"], f'{r["wall_s"]:.1f}')))


if __name__ == "__main__":
    raise SystemExit(main())
