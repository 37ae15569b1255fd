"""Is ``asyncflow plan``'s pick as good as the best placement a full sweep finds? How long does it take?

Usage: python benchmarks/plan_check.py [--config examples/sim_7b.yaml] [--devices 128] [--max-staleness 4]
                                       [--steps 3] [--full-steps N] [--full-json FULL.json] [--plan-only]
                                       [--json] [--bounded-sweep TOL [--pick-json PLAN.json] [--margin M]]
                                       [OVERRIDES...]

The small config of tests/test_plan.py (docs/performance.md, "Lengths-only payloads and the planner"):
    python benchmarks/plan_check.py --devices 32 --max-staleness 1 --steps 2 data.prompts_per_step=8 \
        rollout.max_new_tokens=2048 store.options.capacity=4096

Runs the screened plan (what ``asyncflow plan`` does, on every core) and the full sweep (every placement
simulated over the same steps; or reads an earlier one from ``--full-json``, which this script writes
with ``--save-full``) and reports: the plan's wall time, its pick, the pick's samples/s against the
sweep's best (simulations are deterministic, so the pick's value is the same in both), and the pick's
rank in the sweep. The machine is shared: wall times are one run's.

Both run with cut-offs unless ``--no-cutoff`` (``asyncflow plan --cutoff``): the sweep's best is never cut
off, so the ratio is exact; a sweep row cut off holds an upper bound, and when such a bound lies above the
pick's rate the rank printed is the worst the pick can have (``pick_rank_exact`` false).

``--full-steps N`` measures the sweep over N steps instead of ``--steps`` (a longer reference: a short window
can still hold the first steps after the warm-up, which run ahead or behind the steady rate); the pick is then
judged by its own row in the sweep (``pick_samples_per_s_in_sweep``).

``--bounded-sweep TOL`` checks the pick against every placement that could beat it by more than TOL (e.g. 0.05)
without the full sweep's cost: a placement is simulated only when its work bound
(``asyncflow_core.cli.plan.work_bound_samples_per_s``: the replicas at their largest batch, no tail, training
overlapped for k >= 1; a ceiling at the mean response length, so ``--margin`` (default 0.1) lowers the bar to
cover a finite sample's mean) reaches (1 + TOL) x the pick's rate x (1 - margin), and each such simulation is cut
off once it cannot reach (1 + TOL) x the pick's rate. A row that is not cut off beats the pick by more than TOL
(``beaten_by``); none means the pick is within TOL of every placement simulated, and the rest are excluded by the
bound. ``--pick-json`` reads the pick from an earlier ``--plan-only --json`` output instead of planning again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.cli.plan import run_plan


def _children_cpu_s() -> float:
    """CPU seconds of the finished worker processes so far (the plan's simulations run in them)."""
    import resource

    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ch.ru_utime + ch.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "examples" / "sim_7b.yaml")
    p.add_argument("--devices", type=int, default=128)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--full-json", type=Path, default=None, help="an earlier full sweep (plan.json of --full)")
    p.add_argument("--save-full", type=Path, default=None, help="write the full sweep here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-cutoff", dest="cutoff", action="store_false", help="simulate every step of every run")
    p.add_argument("--full-steps", type=int, default=None, help="measured steps of the sweep (default: --steps)")
    p.add_argument("--plan-only", action="store_true", help="no sweep: the plan's time, simulations and pick")
    p.add_argument("--bounded-sweep", type=float, default=None, metavar="TOL",
                   help="simulate only placements whose work bound may beat the pick by more than TOL")
    p.add_argument("--margin", type=float, default=0.1, help="--bounded-sweep: slack of the work bound")
    p.add_argument("--pick-json", type=Path, default=None, help="--bounded-sweep: the pick of a --plan-only --json")
    p.add_argument("--workers", type=int, default=None, help="simulations at once (default: every core)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.prompts_per_step=8")
    a = p.parse_args(argv)
    space = {"devices": a.devices, "max_k": a.max_staleness, "progress": False, "cutoff": a.cutoff}
    t0 = time.perf_counter()
    if a.bounded_sweep is not None and a.pick_json is not None:
        got = json.loads(a.pick_json.read_text())
        _print(bounded_sweep(a, got["pick"], got["pick_samples_per_s"]), a.json)
        return 0
    plan = run_plan(a.config, a.overrides, measured_steps=a.steps, workers=a.workers, **space)
    if a.bounded_sweep is not None:
        out = bounded_sweep(a, plan.chosen["label"], plan.chosen["samples_per_s"])
        _print({"plan_wall_s": plan.wall_s, **out}, a.json)
        return 0
    plan_cpu = _children_cpu_s()
    if a.plan_only:
        cut = sum(bool(r.get("cut_off")) for r in plan.rows)
        out = {"devices": a.devices, "candidates": plan.candidates, "plan_simulations": plan.simulated,
               "plan_cut_off": cut, "plan_wall_s": plan.wall_s, "plan_cpu_s": plan_cpu, "pick": plan.chosen["label"],
               "pick_samples_per_s": plan.chosen["samples_per_s"]}
        _print(out, a.json)
        return 0
    full_steps = a.full_steps or a.steps
    if a.full_json is not None:
        full = json.loads(a.full_json.read_text())
    else:
        full = asdict(run_plan(a.config, a.overrides, full=True, measured_steps=full_steps, **space))
        if a.save_full is not None:
            a.save_full.write_text(json.dumps(full, default=str))
    best = max(full["rows"], key=lambda r: r["samples_per_s"])
    assert not best.get("cut_off"), "a sweep's best row is never cut off"
    if full_steps == a.steps:
        rate = plan.chosen["samples_per_s"]  # the pick's row in the plan: a finalist, never cut off
    else:  # measured over other steps: the pick's row in the sweep (exact unless cut off, then an upper bound)
        rate = next(r["samples_per_s"] for r in full["rows"] if r["label"] == plan.chosen["label"])
    above = [r for r in full["rows"] if r["label"] != plan.chosen["label"] and r["samples_per_s"] > rate]
    rank = len(above) + 1
    out = {
        "devices": a.devices, "candidates": plan.candidates, "plan_simulations": plan.simulated,
        "plan_wall_s": plan.wall_s, "plan_cpu_s": plan_cpu, "full_wall_s": full["wall_s"],
        "full_steps": full_steps, "elapsed_s": time.perf_counter() - t0,
        "pick": plan.chosen["label"], "pick_samples_per_s": plan.chosen["samples_per_s"],
        "pick_samples_per_s_in_sweep": rate,
        "best": best["label"], "best_samples_per_s": best["samples_per_s"],
        "pick_vs_best": rate / best["samples_per_s"], "pick_rank_in_sweep": rank,
        "pick_rank_exact": not any(r.get("cut_off") for r in above),
        "cutoff": a.cutoff, "plan_cut_off": sum(bool(r.get("cut_off")) for r in plan.rows),
        "full_cut_off": sum(bool(r.get("cut_off")) for r in full["rows"]),
    }
    _print(out, a.json)
    return 0


def bounded_sweep(a: argparse.Namespace, pick: str, rate: float) -> dict:
    """Simulate the placements that may beat ``pick`` (``rate`` samples/s) by more than ``a.bounded_sweep``."""
    from asyncflow_core.cli.plan import _Runner, candidates, floor_variants, work_bound_samples_per_s, workload
    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.config.loader import read_yaml

    t0 = time.perf_counter()
    w = workload(resolve(load_config(a.config, list(a.overrides))))
    every = candidates(a.devices, node_size=8, max_k=a.max_staleness, replicas_per_node=(1, 2, 4, 8))
    every += floor_variants(every)  # as the plan's (the work bound is the same with the start floor)
    target = (1 + a.bounded_sweep) * rate
    bar = target * (1 - a.margin)
    bound = {c: work_bound_samples_per_s(w, c) for c in every}
    chosen = [c for c in every if c.label != pick and bound[c] >= bar]
    pruned = [c for c in every if c.label != pick and bound[c] < bar]
    jobs = a.workers or os.cpu_count() or 1
    with _Runner(read_yaml(a.config), list(a.overrides), jobs, False) as runner:
        rows = runner.run(chosen, a.steps, keep=1, known=[target])
    beaten = sorted(((r["samples_per_s"], r["label"]) for r in rows.values() if not r["cut_off"]), reverse=True)
    return {
        "devices": a.devices, "candidates": len(every), "pick": pick, "pick_samples_per_s": rate,
        "tolerance": a.bounded_sweep, "margin": a.margin, "target_samples_per_s": target,
        "simulated": len(chosen), "pruned_by_bound": len(pruned),
        "pruned_max_bound": max((bound[c] for c in pruned), default=None),
        "cut_off_below_target": sum(bool(r["cut_off"]) for r in rows.values()),
        "highest_cut_off_bound": max((r["samples_per_s"] for r in rows.values() if r["cut_off"]), default=None),
        "beaten_by": [f"{label}: {r:.2f}" for r, label in beaten],
        "pick_within_tolerance": not beaten, "sweep_wall_s": time.perf_counter() - t0,
        "sweep_cpu_s": _children_cpu_s(),
    }


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    for key, value in out.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    raise SystemExit(main())
