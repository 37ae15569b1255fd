"""End to end on this CPU: the arithmetic example in sync, one_step and async (k = 2), one run each.

Usage: python benchmarks/e2e_cpu.py [--config examples/arithmetic_grpo.yaml] [--modes sync,one_step,async2]
                                    [--launcher local,ray] [--engine torch,vllm] [--steps N]
                                    [--out runs/e2e_cpu] [--json] [override ...]

Each mode is a real run (the ``torch`` rollout engine, the ``fsdp`` trainer on
gloo, the in-process store) of the same config with only ``async.*`` changed.
With ``--launcher local,ray`` every mode runs once per launcher (the same
config with only ``launcher.name`` changed; under ``ray`` a loopback-only
single-host Ray is started for the run, the engines and rewards run as
actors and the store on its ray deployment), so the two rows of a mode show
what Ray costs on one machine. ``wall s`` includes start-up (Ray, actors).
With ``--engine torch,vllm`` every mode also runs once per rollout engine
(only ``rollout.name`` changed; ``vllm`` needs vLLM installed: run the script
with ``.venv-vllm/bin/python``), with the weight-sync seconds per step.
Reported per mode: samples/s and tokens/s of wall time (whole run, model
build and start-up excluded: from the first step's start to the last step's
end), seconds to the first step whose mean reward (and exact-match accuracy,
where the reward reports it) reaches 0.8, the final reward (mean of the last
five steps), and each lane's utilisation. ``learning`` holds the figures
``benchmarks/peers/trl_grpo.py`` reports for TRL, computed by the same code
(:mod:`peers.common`): samples/s, the 5-step mean accuracy at fixed steps,
seconds from the first step's start until it reaches 0.5, final accuracy. The reward curves of all modes
are drawn on one plot (``reward_curves.png`` in ``--out``), to see whether
asynchrony changes convergence per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.launcher import launch  # noqa: E402
from asyncflow_core.flow.telemetry import load_metrics, reward_png  # noqa: E402
from peers.common import learning_summary  # noqa: E402

MODES = {"sync": ["async.mode=sync"], "one_step": ["async.mode=one_step"],
         "async2": ["async.mode=async", "async.max_staleness=2"]}
K = {"sync": 0, "one_step": 1, "async2": 2}
LAUNCHERS = ("local", "ray")


def first_reaching(records: list[dict[str, Any]], key: str, level: float) -> float | None:
    """Seconds (the run's clock, from its start) at the end of the first step whose ``key`` is >= ``level``."""
    for r in records:
        if r.get(key) is not None and r[key] >= level:
            return float(r["time_s"])
    return None


def run_mode(config: Path, mode: str, steps: int | None, out: Path, overrides: list[str],
             launcher: str = "local", engine: str | None = None) -> dict[str, Any]:
    extra = [f"trainer.total_steps={steps}"] if steps else []
    if engine is not None:
        extra.append(f"rollout.name={engine}")
    cfg = load_config(config, [*overrides, *MODES[mode], *extra, "trainer.checkpoint_every=0",
                               "trainer.export_final=false", f"launcher.name={launcher}"])
    name = mode if launcher == "local" else f"{mode}-{launcher}"
    run_dir = out / (name if engine is None else f"{name}-{engine}")
    t0 = time.perf_counter()
    summary = launch(resolve(cfg), run_dir=run_dir)
    wall = time.perf_counter() - t0
    records = load_metrics(run_dir / "metrics.jsonl")
    first_start = records[0]["time_s"] - records[0]["step_seconds"]
    span = records[-1]["time_s"] - first_start
    samples = sum(r["samples"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    last = records[-5:]
    acc_key = "reward/correct" if "reward/correct" in records[0] else "reward_mean"
    # the figures benchmarks/peers/trl_grpo.py reports for its side, computed the same way
    steps = [{"step": r["step"], "end_s": r["time_s"] - first_start, "samples": r["samples"],
              "accuracy": r.get(acc_key, 0.0)} for r in records]
    return {
        "mode": mode,
        "launcher": launcher,
        "engine": cfg.rollout.name,
        "max_staleness": K[mode],
        "steps": summary["steps"],
        "samples_per_s": samples / span,
        "tokens_per_s": tokens / span,
        "seconds_to_reward_0_8": first_reaching(records, "reward_mean", 0.8),
        "seconds_to_accuracy_0_8": first_reaching(records, acc_key, 0.8),
        "first_reward": records[0]["reward_mean"],
        "final_reward": statistics.fmean(r["reward_mean"] for r in last),
        "final_accuracy": statistics.fmean(r.get(acc_key, 0.0) for r in last),
        "weight_sync_s_per_step": statistics.fmean(r.get("weight_sync_s") or 0.0 for r in records),
        "utilisation": summary["utilisation"],
        "learning": learning_summary(steps),
        "accuracy_per_step": [s["accuracy"] for s in steps],
        "staleness_histogram": summary["staleness_histogram"],
        "wall_s": wall,
        "run_dir": str(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "examples" / "arithmetic_grpo.yaml")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--launcher", default="local", help="comma-separated launchers to run each mode under: local,ray")
    p.add_argument("--engine", default=None, help="comma-separated rollout engines to run each mode with: torch,vllm "
                   "(default: the config's)")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the config's)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "e2e_cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every mode")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    launchers = [x for x in a.launcher.split(",") if x]
    if not launchers or any(x not in LAUNCHERS for x in launchers):
        p.error(f"--launcher {a.launcher!r}: choose from {','.join(LAUNCHERS)} (comma-separated)")
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    engines: list[str | None] = [e for e in (a.engine or "").split(",") if e] or [None]
    results = [run_mode(a.config, m, a.steps, a.out, a.overrides, launcher=x, engine=e)
               for m in modes for x in launchers for e in engines]

    def label(r: dict[str, Any]) -> str:
        extra = [r["launcher"]] if len(launchers) > 1 else []
        extra += [r["engine"]] if len(engines) > 1 else []
        return r["mode"] + (f" ({', '.join(extra)})" if extra else "")

    series = {label(r): load_metrics(Path(r["run_dir"]) / "metrics.jsonl") for r in results}
    plot = reward_png([], a.out / "reward_curves.png", title="mean reward per step", series=series)
    out = {"results": results, "config": str(a.config), "reward_curves": str(plot)}
    if a.json:
        print(json.dumps(out))
        return 0
    head = ("mode", "launcher", "engine", "k", "steps", "samples/s", "tokens/s", "weight sync s/step",
            "s to reward 0.8", "s to acc 0.8", "first reward", "final reward", "final acc", "wall s")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in results:
        def fmt(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        print(" | ".join(str(x) for x in (
            r["mode"], r["launcher"], r["engine"], r["max_staleness"], r["steps"], f'{r["samples_per_s"]:.1f}',
            f'{r["tokens_per_s"]:.0f}', f'{r["weight_sync_s_per_step"]:.3f}', fmt(r["seconds_to_reward_0_8"]),
            fmt(r["seconds_to_accuracy_0_8"]), f'{r["first_reward"]:.2f}', f'{r["final_reward"]:.2f}',
            f'{r["final_accuracy"]:.2f}', f'{r["wall_s"]:.0f}')))
    print(f"reward curves: {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
