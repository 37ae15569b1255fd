"""How well a calibrated simulation predicts real runs: the arithmetic example on this CPU, several placements.

Usage: python benchmarks/sim_calibration.py [--steps 60] [--steps-10m 30] [--runs-dir runs/calibration ...] [--reuse]
                                            [--json] [--configs sync,sync_b16,...,sync_10m,one_step_10m]
                                            [--calibrate-from sync,sync_b16,one_step,sync_10m,sync_10m_b16,one_step_10m]

1. Runs ``examples/arithmetic_grpo.yaml`` for real (``asyncflow run``, ``--steps`` steps, no checkpoints)
   under each configuration (``--reuse`` keeps run directories that already finished), once per ``--runs-dir``
   (repeat it for repeated runs: the real figure is then the median run's, with the spread). The ``*_10m``
   configurations are the same task on a larger model shape (~9.8M parameters: hidden 256, 10 layers),
   ``--steps-10m`` steps each.
2. Fits the sim latency model per model shape from that shape's ``--calibrate-from`` runs (``asyncflow sim
   --calibrate``), each from its median run: the sync runs at two batch sizes give the engines' costs alone,
   the one_step run how much the engines slow each other down on this machine (the shared host model).
3. Simulates every configuration with its shape's model, and with the same model without the host
   (independent engines), and compares, over the steps after a warm-up of k + 1: steady samples/s, and each
   lane's busy fraction (rollout replicas, trainer).

The machine is shared: other processes slow real steps at random (single train steps stall for
seconds), which no model predicts; the fit uses medians and the rates are over many steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.cli.calibrate import Calibration, fit_runs, simulated_twin
from asyncflow_core.config import load_config, resolve
from asyncflow_core.config.loader import apply_overrides, read_yaml
from asyncflow_core.flow.runtime import run_flow
from asyncflow_core.flow.telemetry import Span, Timeline, load_metrics, load_spans

EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"
#: the larger model shape: 10 x (attention 196k + MLP 786k) ~ 9.8M parameters (the example's is ~0.1M)
SHAPE_10M = ["model.hf_config.hidden_size=256", "model.hf_config.intermediate_size=1024",
             "model.hf_config.num_hidden_layers=10"]
CONFIGS: dict[str, tuple[list[str], int]] = {  # name -> (overrides, k)
    "sync": (["async.mode=sync"], 0),
    "sync_b16": (["async.mode=sync", "data.prompts_per_step=16"], 0),
    "sync_b24": (["async.mode=sync", "data.prompts_per_step=24"], 0),
    "sync_b48": (["async.mode=sync", "data.prompts_per_step=48"], 0),
    "one_step": (["async.mode=one_step"], 1),
    "async2": (["async.mode=async", "async.max_staleness=2"], 2),
    "sync_2rep": (["async.mode=sync", "rollout.replicas=2"], 0),
    "one_step_2rep": (["async.mode=one_step", "rollout.replicas=2"], 1),
    "sync_10m": (["async.mode=sync", *SHAPE_10M], 0),
    "sync_10m_b16": (["async.mode=sync", "data.prompts_per_step=16", *SHAPE_10M], 0),
    "one_step_10m": (["async.mode=one_step", *SHAPE_10M], 1),
    "async2_10m": (["async.mode=async", "async.max_staleness=2", *SHAPE_10M], 2),
}
COMMON = ["trainer.checkpoint_every=0", "trainer.export_final=false"]


def shape(name: str) -> str:
    return "10m" if name.endswith(("_10m", "_10m_b16")) else "tiny"


def steady(run_dir: Path, k: int) -> dict[str, Any]:
    """Samples/s, busy fraction per lane and the trainer's wait for its batch (seconds per step) over the steps after
    the first k + 1 (from the run's files)."""
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
    waits = sum(min(s.end, end) - s.start for s in timeline.spans
                if s.lane == "train" and s.name == "wait_batch" and start <= s.start < end)
    return {"samples_per_s": samples / (end - start), "batch_wait_s": waits / (len(metrics) - warm),
            "utilisation": {lane: round(v, 4) for lane, v in sorted(util.items())
                            if lane.startswith("rollout/") or lane == "train"}}


def real_run(name: str, steps: int, runs_dir: Path, reuse: bool, tree: Path | None = None) -> Path:
    """Run ``name`` for real; from ``tree`` (e.g. ``git archive HEAD`` unpacked) instead of this checkout when
    given, so edits in progress elsewhere in the checkout cannot change what is measured."""
    overrides, _ = CONFIGS[name]
    out = runs_dir / name
    if reuse and (out / "summary.json").is_file():
        return out
    root = tree or REPO
    env = dict(os.environ)
    if tree is not None:  # the venv's editable installs point at this checkout: put the tree first
        env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in (".", "spec", "adapters/fsdp"))
    cmd = [sys.executable, "-m", "asyncflow_core.cli.main", "run", str(root / EXAMPLE.relative_to(REPO)), *overrides,
           *COMMON, f"trainer.total_steps={steps}", "--run-dir", str(out.resolve()), "--no-progress"]
    print(f"... real run {name}: {' '.join(cmd[3:])} (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    subprocess.run(cmd, check=True, cwd=root, stdout=subprocess.DEVNULL, env=env)
    return out


def simulated(name: str, steps: int, cal: Calibration, example: Path = EXAMPLE) -> dict[str, Any]:
    """The steady figures of ``name``'s config simulated with ``cal`` (what ``asyncflow sim --calibrate`` runs);
    ``example``: the example file the real runs used (``--real-tree``'s), so the twin is of what ran."""
    overrides, k = CONFIGS[name]
    ovs = [*overrides, *COMMON, f"trainer.total_steps={steps}"]
    ovs += [*simulated_twin(apply_overrides(read_yaml(example), list(ovs)), cal), "rollout.options.payload=lengths"]
    with tempfile.TemporaryDirectory() as tmp:
        run_flow(resolve(load_config(example, ovs)), virtual=True, run_dir=Path(tmp), write_png=False)
        return steady(Path(tmp), k)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--steps-10m", type=int, default=30, help="steps of the *_10m configurations")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--calibrate-from", default="sync,sync_b16,one_step,sync_10m,sync_10m_b16,one_step_10m",
                   help="the runs each model shape is fitted from (drop one_step for independent engines)")
    p.add_argument("--runs-dir", type=Path, action="append",
                   help="where the real runs go (repeatable: one run of each configuration per directory; default "
                   "runs/calibration)")
    p.add_argument("--reuse", action="store_true", help="keep real runs whose directory already holds a summary")
    p.add_argument("--real-only", action="store_true", help="make the real runs, fit and predict nothing")
    p.add_argument("--real-tree", type=Path, help="run the real runs from this source tree (git archive HEAD | "
                   "tar -x -C DIR), not from this checkout")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    base = [n for n in a.calibrate_from.split(",") if n]
    unknown = [n for n in names + base if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    shapes = list(dict.fromkeys(shape(n) for n in names))
    base = [b for b in base if shape(b) in shapes]
    missing = [s for s in shapes if not any(shape(b) == s for b in base)]
    if missing:
        p.error(f"no --calibrate-from run of the model shape(s) {missing}")

    def steps(n: str) -> int:
        return a.steps_10m if shape(n) == "10m" else a.steps

    runs_dirs = a.runs_dir or [REPO / "runs" / "calibration"]
    repeats = {n: [real_run(n, steps(n), d, a.reuse, a.real_tree) for d in runs_dirs]
               for n in dict.fromkeys(base + names)}
    if a.real_only:
        return 0
    figures = {n: [steady(d, CONFIGS[n][1]) for d in ds] for n, ds in repeats.items()}
    median = {n: sorted(range(len(f)), key=lambda i: f[i]["samples_per_s"])[(len(f) - 1) // 2]
              for n, f in figures.items()}  # the median run (the lower middle one of an even count)
    dirs = {n: repeats[n][median[n]] for n in repeats}
    cals = {s: fit_runs([dirs[b] for b in base if shape(b) == s]) for s in shapes}
    example = (a.real_tree or REPO) / EXAMPLE.relative_to(REPO)  # the twin of what ran (the tree's example)
    alone = {s: Calibration(**{**vars(c), "host": {}}) for s, c in cals.items()}
    rows = []
    for n in names:
        k = CONFIGS[n][1]
        real = figures[n][median[n]]
        rates = [f["samples_per_s"] for f in figures[n]]
        sim = simulated(n, steps(n), cals[shape(n)], example)
        ind = simulated(n, steps(n), alone[shape(n)], example) if cals[shape(n)].host else sim
        lanes = sorted(set(real["utilisation"]) | set(sim["utilisation"]))
        rows.append({
            "config": n, "k": k, "calibration_run": n in base, "run_dir": str(dirs[n]),
            "real_samples_per_s": real["samples_per_s"], "sim_samples_per_s": sim["samples_per_s"],
            "real_runs_samples_per_s": rates, "real_spread": (max(rates) - min(rates)) / real["samples_per_s"],
            "error": sim["samples_per_s"] / real["samples_per_s"] - 1,
            "independent_samples_per_s": ind["samples_per_s"],
            "independent_error": ind["samples_per_s"] / real["samples_per_s"] - 1,
            "utilisation": {lane: {"real": real["utilisation"].get(lane, 0.0), "sim": sim["utilisation"].get(lane, 0.0)}
                            for lane in lanes},
            "batch_wait_s": {"real": real["batch_wait_s"], "sim": sim["batch_wait_s"]},
        })
    out = {"steps": a.steps, "steps_10m": a.steps_10m, "calibrated_from": base,
           "fit": {s: c.dump() for s, c in cals.items()}, "results": rows}
    if a.json:
        print(json.dumps(out))
        return 0
    print("| config | k | real samples/s (spread) | sim samples/s | error | no host: error | busy real -> sim | "
          "train waits for its batch, ms a step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        util = ", ".join(f"{lane} {u['real']:.2f} -> {u['sim']:.2f}" for lane, u in r["utilisation"].items())
        tag = " (fit)" if r["calibration_run"] else ""
        print(f"| {r['config']}{tag} | {r['k']} | {r['real_samples_per_s']:.1f} ({r['real_spread']:.0%}) | "
              f"{r['sim_samples_per_s']:.1f} | {r['error']:+.1%} | {r['independent_error']:+.1%} | {util} | "
              f"{r['batch_wait_s']['real'] * 1e3:.1f} -> {r['batch_wait_s']['sim'] * 1e3:.1f} |")
    for s, c in cals.items():
        print(f"host ({s}): {c.host or 'not fitted'}; fit rates {c.fit.get('host')}")
        for note in c.notes:
            print(f"note ({s}): {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
