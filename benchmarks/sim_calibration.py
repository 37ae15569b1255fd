"""How well a calibrated simulation predicts real runs: the arithmetic example on this CPU, several placements.

Usage: python benchmarks/sim_calibration.py [--steps 60] [--runs-dir runs/calibration] [--reuse] [--json]
                                            [--configs sync,sync_b16,sync_b24,sync_b48,one_step,async2,sync_2rep,one_step_2rep]
                                            [--calibrate-from sync,sync_b16]

1. Runs ``examples/arithmetic_grpo.yaml`` for real (``asyncflow run``, ``--steps`` steps, no checkpoints)
   under each configuration (``--reuse`` keeps run directories that already finished).
2. Fits the sim latency model from the ``--calibrate-from`` runs (``asyncflow sim --calibrate``: two
   batch sizes, so a decode pass's fixed cost and its per-token cost are both fitted).
3. Simulates every configuration with that model and compares, over the steps after a warm-up of
   k + 1: steady samples/s, and each lane's busy fraction (rollout replicas, trainer).

The machine is shared: other processes slow real steps at random (single train steps stall for
seconds), which no model predicts; the fit uses medians and the rates are over many steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.cli.calibrate import fit_runs, sim_overrides
from asyncflow_core.config import load_config, resolve
from asyncflow_core.flow.runtime import run_flow
from asyncflow_core.flow.telemetry import Span, Timeline, load_metrics, load_spans

EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"
CONFIGS: dict[str, tuple[list[str], int]] = {  # name -> (overrides, k)
    "sync": (["async.mode=sync"], 0),
    "sync_b16": (["async.mode=sync", "data.prompts_per_step=16"], 0),
    "sync_b24": (["async.mode=sync", "data.prompts_per_step=24"], 0),
    "sync_b48": (["async.mode=sync", "data.prompts_per_step=48"], 0),
    "one_step": (["async.mode=one_step"], 1),
    "async2": (["async.mode=async", "async.max_staleness=2"], 2),
    "sync_2rep": (["async.mode=sync", "rollout.replicas=2"], 0),
    "one_step_2rep": (["async.mode=one_step", "rollout.replicas=2"], 1),
}
COMMON = ["trainer.checkpoint_every=0", "trainer.export_final=false"]


def steady(run_dir: Path, k: int) -> dict[str, Any]:
    """Samples/s and busy fraction per lane over the steps after the first k + 1 (from the run's files)."""
    metrics = [m for m in load_metrics(run_dir / "metrics.jsonl") if "step" in m]
    warm = k + 1
    if len(metrics) <= warm:
        raise SystemExit(f"{run_dir}: {len(metrics)} steps, need more than the warm-up of {warm}")
    start, end = metrics[warm - 1]["time_s"], metrics[-1]["time_s"]
    samples = sum(m["samples"] for m in metrics[warm:])
    timeline = Timeline(lambda: 0.0)
    timeline.t0 = 0.0
    timeline.spans = [Span(s.lane, s.name, s.start, s.end) for s in load_spans(run_dir)]
    util = timeline.utilisation(start, end)
    return {"samples_per_s": samples / (end - start),
            "utilisation": {lane: round(v, 4) for lane, v in sorted(util.items())
                            if lane.startswith("rollout/") or lane == "train"}}


def real_run(name: str, steps: int, runs_dir: Path, reuse: bool) -> Path:
    overrides, _ = CONFIGS[name]
    out = runs_dir / name
    if reuse and (out / "summary.json").is_file():
        return out
    cmd = [sys.executable, "-m", "asyncflow_core.cli.main", "run", str(EXAMPLE), *overrides, *COMMON,
           f"trainer.total_steps={steps}", "--run-dir", str(out), "--no-progress"]
    print(f"... real run {name}: {' '.join(cmd[3:])}", file=sys.stderr)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def simulated(name: str, steps: int, calibrate_from: list[Path]) -> dict[str, Any]:
    overrides, k = CONFIGS[name]
    ovs = sim_overrides(EXAMPLE, [*overrides, *COMMON, f"trainer.total_steps={steps}"], calibrate=calibrate_from)
    with tempfile.TemporaryDirectory() as tmp:
        run_flow(resolve(load_config(EXAMPLE, ovs)), virtual=True, run_dir=Path(tmp), write_png=False)
        return steady(Path(tmp), k)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--calibrate-from", default="sync,sync_b16")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "calibration")
    p.add_argument("--reuse", action="store_true", help="keep real runs whose directory already holds a summary")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    base = [n for n in a.calibrate_from.split(",") if n]
    unknown = [n for n in names + base if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    dirs = {n: real_run(n, a.steps, a.runs_dir, a.reuse) for n in dict.fromkeys(base + names)}
    cal = fit_runs([dirs[n] for n in base])
    rows = []
    for n in names:
        k = CONFIGS[n][1]
        real = steady(dirs[n], k)
        sim = simulated(n, a.steps, [dirs[b] for b in base])
        lanes = sorted(set(real["utilisation"]) | set(sim["utilisation"]))
        rows.append({
            "config": n, "k": k, "calibration_run": n in base,
            "real_samples_per_s": real["samples_per_s"], "sim_samples_per_s": sim["samples_per_s"],
            "error": sim["samples_per_s"] / real["samples_per_s"] - 1,
            "utilisation": {lane: {"real": real["utilisation"].get(lane, 0.0), "sim": sim["utilisation"].get(lane, 0.0)}
                            for lane in lanes},
        })
    out = {"steps": a.steps, "calibrated_from": base, "fit": cal.dump(), "results": rows}
    if a.json:
        print(json.dumps(out))
        return 0
    print("| config | k | real samples/s | sim samples/s | error | busy real -> sim |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        util = ", ".join(f"{lane} {u['real']:.2f} -> {u['sim']:.2f}" for lane, u in r["utilisation"].items())
        tag = " (fit)" if r["calibration_run"] else ""
        print(f"| {r['config']}{tag} | {r['k']} | {r['real_samples_per_s']:.1f} | {r['sim_samples_per_s']:.1f} | "
              f"{r['error']:+.1%} | {util} |")
    for note in cal.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
