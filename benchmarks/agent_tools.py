"""Decode utilisation with slow tools: the multi-turn guess example with every environment step sleeping 50-500 ms.

Usage: python benchmarks/agent_tools.py [--config examples/agent_guess.yaml] [--steps 10] [--delay 0.05,0.5]
                                        [--out runs/agent_tools] [--json] [override ...]

Two real runs of the same config (the ``torch`` rollout engine, the ``fsdp``
trainer, the in-process store), ``--steps`` steps each: one where every
``guess`` step first awaits a uniform ``--delay`` lo..hi seconds (the
environment's ``step_delay_s`` option: a slow tool, reported as the step's
``tool_seconds``), and the same run with no delay for reference. Reported per
run: the rollout lane's utilisation (``rollout/0``: the share of time a
request was being decoded) while generating (from the first decode to the
last environment call, from the run's ``spans.jsonl``) and over the whole run
(the run summary's ``utilisation``, which also counts start-up and the
trainer's last steps after the rollout is done), the share of that window at
least one environment call ran (``env/0``) and the most calls at once (the
``env/<k>`` lanes), environment seconds per episode (``episode/env_s``),
turns per episode, and samples/s (whole run and steady).

The target: with the slow tool the rollout lane stays >= 80 % busy while
generating. That needs enough episodes open that some always have a turn to
decode while the others wait on their tool -- ``environment.workers`` (64 by
default) bounds the episodes open at once, ``rollout.max_inflight`` the
requests -- and a trainer that does not hold the rollout back
(``async.max_staleness``). The script's defaults, applied before the command
line's overrides: ``environment.workers=256`` (every episode of a step: 32
prompts x 8), ``async.mode=async``, ``async.max_staleness=8``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.launcher import launch  # noqa: E402
from asyncflow_core.flow.telemetry import Timeline, load_metrics, load_spans  # noqa: E402

TARGET = 0.8  #: the rollout lane's utilisation the slow-tool run should keep while generating
DEFAULTS = ["environment.workers=256", "async.mode=async", "async.max_staleness=8"]


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def one_run(config: str, name: str, delay: tuple[float, float], steps: int, out: Path,
            overrides: list[str]) -> dict[str, Any]:
    cfg = load_config(config, [*DEFAULTS, *overrides, f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
                               f"environment.options.step_delay_s=[{delay[0]}, {delay[1]}]"])
    run_dir = out / name
    summary = launch(resolve(cfg), run_dir=run_dir)
    records = load_metrics(run_dir / "metrics.jsonl")
    lanes = sorted(lane for lane in summary["utilisation"] if lane.startswith("rollout/"))
    timeline = Timeline(lambda: 0.0)
    timeline.spans = load_spans(run_dir)
    decode = [s for s in timeline.spans if s.lane in lanes and s.name == "generate"]
    env = [s for s in timeline.spans if s.lane.startswith("env/")]
    start = min(s.start for s in decode)
    end = max(s.end for s in decode + env)
    window = timeline.utilisation(start, end)

    return {
        "run": name,
        "step_delay_s": list(delay),
        "steps": summary["steps"],
        "rollout_lanes": lanes,
        "rollout_util_generating": statistics.fmean(window.get(lane, 0.0) for lane in lanes),
        "rollout_util_run": statistics.fmean(summary["utilisation"][lane] for lane in lanes),
        "generating_s": end - start,
        "env_busy_generating": window.get("env/0", 0.0),
        "env_calls_at_once": len({s.lane for s in env}),
        "env_s_per_episode": _mean(records, "episode/env_s"),
        "turns_per_episode": _mean(records, "episode/turns"),
        "reward_mean": _mean(records, "reward_mean"),
        "samples_per_s": summary["samples_per_s"],
        "steady_samples_per_s": summary["steady_samples_per_s"],
        "run_seconds": summary["run_seconds"],
        "max_inflight": cfg.rollout.max_inflight,
        "env_workers": cfg.environment.workers if cfg.environment is not None else None,
        "run_dir": str(run_dir),
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "agent_guess.yaml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--delay", default="0.05,0.5", help="lo,hi seconds each environment step sleeps")
    ap.add_argument("--out", default="runs/agent_tools")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), applied to both runs")
    a = ap.parse_args(argv)
    try:
        lo, hi = (float(x) for x in a.delay.split(","))
    except ValueError:
        print(f"--delay wants lo,hi seconds (e.g. 0.05,0.5), got {a.delay!r}", file=sys.stderr)
        return 2
    out = Path(a.out)
    results = [one_run(a.config, "slow_tool", (lo, hi), a.steps, out, a.overrides),
               one_run(a.config, "no_delay", (0.0, 0.0), a.steps, out, a.overrides)]
    slow = results[0]
    verdict = {"target_rollout_util": TARGET, "met": slow["rollout_util_generating"] >= TARGET}
    if a.json:
        print(json.dumps({"results": results, **verdict}, indent=2))
        return 0
    cols = [("run", "run", "s"), ("delay s", "step_delay_s", ""),
            ("rollout util (generating)", "rollout_util_generating", ".3f"),
            ("rollout util (run)", "rollout_util_run", ".3f"), ("env busy (generating)", "env_busy_generating", ".3f"),
            ("env calls at once", "env_calls_at_once", "d"), ("env s/episode", "env_s_per_episode", ".3f"),
            ("turns", "turns_per_episode", ".2f"), ("samples/s", "samples_per_s", ".1f"),
            ("steady samples/s", "steady_samples_per_s", ".1f")]
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[k]) if not spec or spec == "s" else _fmt(r[k], spec)
                                for _, k, spec in cols) + " |")
    print(f"max_inflight {slow['max_inflight']}, environment.workers {slow['env_workers']}; target rollout "
          f"utilisation >= {TARGET:.0%} while generating with the slow tool: {'met' if verdict['met'] else 'missed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
