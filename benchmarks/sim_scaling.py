"""Simulated scaling: sync vs streaming vs delayed-update modes at 32-1,024 devices, on the virtual clock.

Usage: python benchmarks/sim_scaling.py [--devices 32,128,512,1024] [--modes sync,stream,one_step,async2,async4]
                                        [--steps 4] [--samples-per-device 16]
                                        [--max-new-tokens 8192] [--payload lengths|tokens]
                                        [--set KEY=VALUE ...] [--workers 1] [--json]

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

``ideal``: rollout and training perfectly
overlapped, so a step costs max(rollout seconds, train seconds) of *modelled
work*, minimised over every trainer/rollout split in whole nodes. Rollout
seconds are the step's prefill plus decode tokens per replica at the best
throughput the latency model allows (the running batch at
``max_running_seqs`` or the KV-cache limit, whichever is smaller, with no
tail and no idle replica); train seconds are ``train_time`` of the step's
tokens. No schedule beats it, so ``efficiency_vs_ideal`` = samples_per_s /
ideal is at most 1; it is low wherever rollout is latency-bound (few
samples per device, long tails) rather than throughput-bound.

``samples_per_s`` is the steady rate: samples trained per second over the
``--steps`` steps that follow a warm-up of k + 1 steps. With bound k the
feeder admits (k + 1) batches at the start, so the first k + 1 steps either
wait for the pipeline to fill or drain what the fill pre-generated; only
after them does each step admit exactly one new batch, as in a long run.
``samples_per_s_with_fill`` is the whole-run figure.

``overlap bound``: the ``stream`` run's rollout phase (everything but the
trainer's busy time) and train phase overlapped perfectly — what a delayed
update could reach if it hid the shorter phase and changed nothing else.
``vs overlap`` near or above 1 means the runtime overlaps as well as the
workload allows and the remaining gap to ``ideal`` is the rollout tail.

``--max-new-tokens`` changes the response cap (the tail) for every mode.
``--set KEY=VALUE`` (repeatable; dotted config keys, YAML values) changes
the config of every mode but ``sync`` (the baseline stays as it is), e.g.
``--set async.overprovision=1.0`` for a tail policy (docs/simulation.md,
"Tail policies").
``--payload`` picks what the sim rollout engines return: ``lengths`` (the
default: zero-width token ids and log-probs, the same schedule) or
``tokens`` (full token tensors through the store). ``--workers`` runs that
many simulations at once (one process each), the most expensive first
(devices x simulated steps), so the last to start are the short ones; the
rows are printed in the order asked. ``wall s`` is each run's own,
``cpu s`` the CPU seconds it used (what it costs on a machine shared with
other jobs, where wall time depends on the load).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import resource
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


def _costs(samples: int, dr: int, dt: int, *, saturated: bool, max_new: int = MAX_NEW) -> tuple[float, float]:
    """Modelled (rollout, train) seconds of one step of ``samples`` on ``dr`` replicas and ``dt`` trainer devices.

    ``saturated``: decode at the largest batch the replica can run (the ideal);
    otherwise at the batch one step's share of samples gives (k = 0).
    """
    roll, lengths = RolloutLatency(), ResponseLengths()
    resp = expected_response_tokens(lengths, max_new)
    per_replica = samples / dr
    full = min(roll.max_running_seqs, int(roll.kv_capacity_tokens // (PROMPT_TOKENS + resp)))
    batch = full if saturated else max(1, min(full, int(per_replica)))
    rollout_s = per_replica * (resp / roll.decode_throughput(batch) + roll.prefill_time(PROMPT_TOKENS))
    train_s = TrainLatency(devices=dt).train_time(int(samples * (PROMPT_TOKENS + resp)))
    return rollout_s, train_s


def best_split(devices: int, samples: int, *, saturated: bool, max_new: int = MAX_NEW) -> tuple[int, int, float]:
    """(rollout devices, trainer devices, step seconds): trainer in whole nodes, minimising max(rollout, train)."""
    best = None
    for t_nodes in range(1, devices // 8):
        dt = 8 * t_nodes
        cost = max(_costs(samples, devices - dt, dt, saturated=saturated, max_new=max_new))
        if best is None or cost < best[2]:
            best = (devices - dt, dt, cost)
    assert best is not None
    return best


def split(devices: int, samples: int, max_new: int = MAX_NEW) -> tuple[int, int]:
    """Placement of the task-separated modes: balance the modelled per-step cost at k = 0 batches."""
    dr, dt, _ = best_split(devices, samples, saturated=False, max_new=max_new)
    return dr, dt


def ideal_samples_per_s(devices: int, samples: int, max_new: int = MAX_NEW) -> float:
    """Samples per second with rollout and training perfectly overlapped on the best split (modelled work)."""
    return samples / best_split(devices, samples, saturated=True, max_new=max_new)[2]


def _set(data: dict[str, Any], sets: tuple[str, ...]) -> None:
    """Apply ``KEY=VALUE`` settings (dotted keys, YAML values) to a config dict."""
    import yaml

    for item in sets:
        key, _, value = item.partition("=")
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)


def config(devices: int, mode: str, steps: int, samples_per_device: int, max_new: int = MAX_NEW,
           payload: str = "lengths", sets: tuple[str, ...] = ()) -> RunConfig:
    async_mode, k = MODES[mode]
    samples = samples_per_device * devices
    prompts = samples // N
    if mode == "sync":
        replicas, trainer_devices = devices, devices
    else:
        replicas, trainer_devices = split(devices, samples, max_new)
    data = {
        "name": f"sim-{devices}-{mode}",
        "data": {"name": "sim", "options": {"size": prompts * (steps + k + 2), "prompt_tokens": PROMPT_TOKENS},
                 "prompts_per_step": prompts, "shuffle": False},
        "rollout": {"name": "sim", "replicas": replicas, "n": N, "max_new_tokens": max_new, "max_inflight": 256,
                    "rows_per_lease": 256, "kv_cache": "keep",
                    "options": {"payload": payload}},
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
    if mode != "sync":
        _set(data, sets)
        extra = math.ceil(float(data["async"].get("overprovision", 0)))  # over-provisioned prompts stay live too
        data["store"]["options"]["capacity"] = max(65536, (k + 3 + extra) * samples)
    return RunConfig.model_validate(data)


def cpu_seconds() -> float:
    """CPU seconds (user + system) this process has used: on a shared machine, what a run cost, unlike its wall."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def warmup_steps(mode: str) -> int:
    """Steps before a mode's pipeline is in steady state: the first k + 1 batches were all admitted at the start."""
    return MODES[mode][1] + 1


def measured_rate(step_end_s: list[float], warm: int, samples_per_step: int) -> float:
    """Samples/s over the steps after the first ``warm`` ones (each step trains ``samples_per_step``)."""
    measured = len(step_end_s) - warm
    if measured < 1:
        raise ValueError(f"need more than {warm} steps to measure after the warm-up, got {len(step_end_s)}")
    return measured * samples_per_step / (step_end_s[-1] - step_end_s[warm - 1])


def schedule_digest(summary: dict[str, Any]) -> str:
    """A hash of everything a run decided (step end times, staleness histogram, ledger, counters, utilisation...):
    the whole summary but its wall time. Two trees that give one digest on one config gave the same schedule."""
    kept = {k: v for k, v in summary.items() if k != "wall_seconds"}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_one(devices: int, mode: str, steps: int, samples_per_device: int, max_new: int = MAX_NEW,
            payload: str = "lengths", sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """One mode at one size: ``steps`` measured steps after the mode's warm-up steps."""
    warm = warmup_steps(mode)
    cfg = config(devices, mode, warm + steps, samples_per_device, max_new, payload, sets)
    t0, c0 = time.perf_counter(), cpu_seconds()
    s = run_flow(resolve(cfg), virtual=True, write_png=False)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    util = s["utilisation"]
    rollout_busy = [v for lane, v in util.items() if lane.startswith("rollout/")]
    return {
        "devices": devices,
        "mode": mode,
        "max_staleness": MODES[mode][1],
        "rollout_replicas": cfg.rollout.replicas,
        "trainer_devices": cfg.trainer.options["latency"]["devices"],
        "samples_per_s": measured_rate(s["step_end_s"], warm, samples_per_device * devices),
        "warmup_steps": warm,
        "samples_per_s_with_fill": s["samples_per_s"],
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
        "cpu_s": cpu,
        "schedule_digest": schedule_digest(s),
        "payload": payload,
        "set": list(sets) if mode != "sync" else [],
        "counters": s["counters"],
        "mean_trained_response_tokens": s["tokens_trained"] / max(1, s["samples_trained"]) - PROMPT_TOKENS,
    }


def _run_in_worker(args: tuple) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # one simulation per core
    return run_one(*args)


def _overlap_bound(stream: dict[str, Any] | None, samples_per_step: int) -> float | None:
    """Samples/s if the ``stream`` run's rollout phase and train phase overlapped perfectly on the same split.

    The ``stream`` run (k = 0) does them one after the other: its step is the
    trainer's busy time plus everything else (rollout with its tail, reward,
    weight sync). A delayed update can at best overlap the two, so this is
    what ``one_step`` would reach if it hid the shorter phase completely and
    the rollout's tail did not change; modes that also overlap tails across
    steps (k >= 1 admitting more prompts) can exceed it.
    """
    if stream is None:
        return None
    step_s = samples_per_step / stream["samples_per_s"]
    train_s = stream["train_busy_s_per_step"]
    return samples_per_step / max(train_s, step_s - train_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="32,128,512,1024")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=4, help="measured steps after the warm-up (default: %(default)s)")
    p.add_argument("--samples-per-device", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="response cap (default: %(default)s)")
    p.add_argument("--payload", choices=("lengths", "tokens"), default="lengths",
                   help="what the sim rollout engines return (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config setting for every mode but sync (dotted key, YAML value; repeatable)")
    p.add_argument("--workers", type=int, default=1, help="simulations at once, one process each")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--jsonl", type=Path, default=None,
                   help="also append each device count's rows to this file as they finish (long sweeps)")
    a = p.parse_args(argv)
    modes = list(dict.fromkeys(m for m in a.modes.split(",") if m))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    if a.max_new_tokens < 1 or a.steps < 1 or a.samples_per_device < N:
        p.error(f"need --max-new-tokens >= 1, --steps >= 1 and --samples-per-device >= {N} (one prompt of n = {N})")
    results: list[dict[str, Any]] = []
    sizes = list(dict.fromkeys(int(d) for d in a.devices.split(",") if d))
    for devices in sizes:
        if devices < 16 or devices % 8:
            p.error(f"--devices {devices}: use multiples of 8, at least 16 (the trainer takes whole 8-device nodes)")
    t0 = time.perf_counter()
    bad = [s for s in a.set if "=" not in s]
    if bad:
        p.error(f"--set {bad[0]}: use KEY=VALUE, e.g. --set async.overprovision=1.0")
    jobs = [(d, m, a.steps, a.samples_per_device, a.max_new_tokens, a.payload, tuple(a.set))
            for d in sizes for m in modes]
    if a.workers > 1:
        _report(a, _run_pool(jobs, a.workers, modes), results)
        order = {(d, m): i for i, (d, m, *_) in enumerate(jobs)}
        results.sort(key=lambda r: order[(r["devices"], r["mode"])])  # the order asked, whatever finished first
    else:
        _report(a, ((d, [run_one(*job) for job in jobs if job[0] == d]) for d in sizes), results)
    out = {"results": results, "steps": a.steps, "samples_per_device": a.samples_per_device, "n": N,
           "max_new_tokens": a.max_new_tokens, "payload": a.payload, "workers": a.workers,
           "sweep_wall_s": time.perf_counter() - t0, "sweep_cpu_s": sum(r["cpu_s"] for r in results)}
    if a.json:
        print(json.dumps(out))
    else:
        _table(out)
    return 0


def expected_cost(job: tuple) -> int:
    """A simulation's relative cost for ordering a sweep: devices x simulated steps (warm-up included). The CPU
    seconds measured follow it roughly: 1,024 devices ~25x 32, async4 ~2x sync (docs/performance.md, "Simulator
    speed"); only the order is used."""
    devices, mode, steps = job[0], job[1], job[2]
    return devices * (warmup_steps(mode) + steps)


def _run_pool(jobs: list[tuple], workers: int, modes: list[str]) -> Any:
    """Run ``jobs`` on ``workers`` processes, longest first (the greedy longest-processing-time order: the last
    simulations to start are the short ones, so the workers finish together instead of one waiting on a 1,024-device
    row started last). Yields (devices, rows in the order of ``modes``) as each size's rows are all done."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_in_worker, job): job for job in sorted(jobs, key=expected_cost, reverse=True)}
        pending = collections.Counter(job[0] for job in jobs)
        done: dict[int, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
        for fut in as_completed(futures):
            row = fut.result()
            done[row["devices"]][row["mode"]] = row
            pending[row["devices"]] -= 1
            if not pending[row["devices"]]:
                yield row["devices"], [done[row["devices"]][m] for m in modes]


def _report(a: argparse.Namespace, by_size: Any, results: list[dict[str, Any]]) -> None:
    """Add the sweep's comparisons to each size's rows (as each size finishes) and append them to --jsonl."""
    for devices, rows in by_size:
        by = {r["mode"]: r for r in rows}
        samples_per_step = a.samples_per_device * devices
        ideal = ideal_samples_per_s(devices, samples_per_step, a.max_new_tokens)
        overlap = _overlap_bound(by.get("stream"), samples_per_step)
        base = by.get("sync")
        for r in rows:
            r["ideal_samples_per_s"] = ideal
            r["efficiency_vs_ideal"] = r["samples_per_s"] / ideal
            r["overlap_bound_samples_per_s"] = overlap
            r["vs_overlap_bound"] = r["samples_per_s"] / overlap if overlap else math.nan
            r["speedup_vs_sync"] = r["samples_per_s"] / base["samples_per_s"] if base else math.nan
        results.extend(rows)
        if a.jsonl is not None:
            with a.jsonl.open("a") as fh:
                for r in rows:
                    fh.write(json.dumps(r) + "\n")
        if not a.json:
            print(f"... {devices} devices done", file=sys.stderr)


def _table(out: dict[str, Any]) -> None:
    print(f"sweep: {out['sweep_wall_s']:.0f} s wall, {out['sweep_cpu_s']:.0f} CPU s in the simulations "
          f"({out['workers']} worker(s), payload {out['payload']})")
    head = ("devices", "mode", "k", "roll/train dev", "samples/s", "vs sync", "vs ideal", "vs overlap", "stale>k",
            "requeued", "wall s", "cpu s")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in out["results"]:
        print(" | ".join(str(x) for x in (
            r["devices"], r["mode"], r["max_staleness"], f'{r["rollout_replicas"]}/{r["trainer_devices"]}',
            f'{r["samples_per_s"]:.2f}', f'{r["speedup_vs_sync"]:.2f}x', f'{r["efficiency_vs_ideal"]:.2f}',
            f'{r["vs_overlap_bound"]:.2f}', r["violations"], r["requeued"], f'{r["wall_s"]:.1f}',
            f'{r["cpu_s"]:.1f}')))


if __name__ == "__main__":
    raise SystemExit(main())
