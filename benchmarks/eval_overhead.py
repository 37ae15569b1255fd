"""What validation during training costs: the arithmetic example with and without an ``eval`` section.

Runs ``examples/arithmetic_grpo.yaml`` for ``--steps`` steps as ``asyncflow run`` subprocesses, alternating a
run without eval and one that evaluates every ``--every`` versions on the rollout replica (``--prompts`` held-out
prompts from another seed of the generator x ``--samples`` completions: pass@1, pass@k, mean reward), for
``--pairs`` pairs. Prints, per run, the process's wall time, samples/s and steady samples/s (summary.json),
and the medians' ratios: the issue's target is at most +10 % wall time at every 20 steps.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/eval_overhead.py --pairs 2          # add --json for one object
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ASYNCFLOW = str(Path(sys.executable).parent / "asyncflow")


def eval_section(every: int, prompts: int, samples: int, priority: float | None) -> dict:
    section = {
        "datasets": [{"name": "arithmetic", "label": "held_out", "max_prompts": prompts,
                      "options": {"size": prompts, "operators": "+", "min_digits": 1, "max_digits": 1, "seed": 1}}],
        "every_steps": every, "samples_per_prompt": samples, "metrics": ["pass@1", "pass@k", "mean_reward"],
        "at_start": False, "at_end": True,
    }
    if priority is not None:
        section["priority"] = priority
    return section


def one_run(config: Path, run_dir: Path, steps: int) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([ASYNCFLOW, "run", str(config), f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
                           "--run-dir", str(run_dir), "--no-progress"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"asyncflow run {config.name} failed: {done.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_version" in r]
    return {"wall_s": round(wall, 2), "samples_per_s": round(summary["samples_per_s"], 1),
            "steady_samples_per_s": round(summary["steady_samples_per_s"] or 0.0, 1), "evals": len(evals),
            "eval_versions": [r["eval_version"] for r in evals],
            "version_mismatch": sum(r.get("eval/version_mismatch", 0) for r in evals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--priority", type=float, default=None,
                    help="eval.priority, the share of a replica's slots eval may take (default: the config's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    base = yaml.safe_load((ROOT / "examples" / "arithmetic_grpo.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        plain, with_eval = tmp_path / "plain.yaml", tmp_path / "eval.yaml"
        plain.write_text(yaml.safe_dump(base))
        with_eval.write_text(yaml.safe_dump({**base, "eval": eval_section(args.every, args.prompts, args.samples, args.priority)}))
        rows: list[dict] = []
        for i in range(args.pairs):  # alternate, so a change in the machine's load hits both sides alike
            for name, cfg in (("no eval", plain), (f"eval every {args.every}", with_eval)):
                rows.append({"run": name, "pair": i + 1, **one_run(cfg, tmp_path / f"{i}-{cfg.stem}", args.steps)})
    med = {name: {k: statistics.median(r[k] for r in rows if r["run"] == name)
                  for k in ("wall_s", "samples_per_s", "steady_samples_per_s")}
           for name in dict.fromkeys(r["run"] for r in rows)}
    a, b = list(med.values())
    out = {"rows": rows, "medians": med, "wall_overhead": round(b["wall_s"] / a["wall_s"] - 1, 4),
           "samples_per_s_change": round(b["samples_per_s"] / a["samples_per_s"] - 1, 4),
           "target_wall_overhead": 0.10, "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'run':<16} {'pair':>4} {'wall s':>8} {'samples/s':>10} {'steady':>8} {'evals':>6} {'mismatch':>8}")
    for r in rows:
        print(f"{r['run']:<16} {r['pair']:>4} {r['wall_s']:>8} {r['samples_per_s']:>10} "
              f"{r['steady_samples_per_s']:>8} {r['evals']:>6} {r['version_mismatch']:>8}")
    print(f"medians: wall {out['wall_overhead']:+.1%}, samples/s {out['samples_per_s_change']:+.1%} "
          f"(target: wall <= +10%); load average {out['load_average']:.1f}")


if __name__ == "__main__":
    main()
