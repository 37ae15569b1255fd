"""Decode utilisation with slow tools: the multi-turn guess example with every environment step taking 50-500 ms.

Usage: python benchmarks/agent_tools.py [--config examples/agent_guess.yaml] [--steps 10] [--delay 0.05,0.5]
                                        [--blocking] [--out runs/agent_tools] [--json] [override ...]
       python benchmarks/agent_tools.py --hop 256      # the worker-process hop alone, no run

Two real runs of the same config (the ``torch`` rollout engine, the ``fsdp``
trainer, the in-process store), ``--steps`` steps each: one where every
``guess`` step first waits a uniform ``--delay`` lo..hi seconds (a slow tool,
reported as the step's ``tool_seconds``), and the same run with no delay (the
zero-latency reference, measured in the same invocation). The wait is the
environment's ``step_delay_s`` option (``await asyncio.sleep``: the
environment runs in the rollout process's event loop); with ``--blocking`` it
is ``time.sleep`` instead, in the ``guess_blocking`` environment this script
registers, which declares ``features.blocking`` and so runs in the
environment pool's worker processes (``environment.processes``, default 2).

Reported per run: the rollout lane's utilisation (``rollout/0``: the share of
time at least one request was being decoded) while generating (from the
first decode to the last environment call, from the run's ``spans.jsonl``),
from the run's first span to its last (adds the trainer's last steps and,
with worker processes, their start) and over the whole run (the run
summary's ``utilisation``, which also counts start-up: ``first span s`` is
how long that took, and the first run in this process pays the imports and
warm-up, so compare whole-run figures with care). Then, for the generating
window: the share of the decoder's idle time during which at least one
environment call ran; the share of the window the feeder waited on admission
(``admission_wait``: the staleness bound forbade new rows, so the rollout
had every row it was allowed); the ``train`` lane's utilisation; the share
at least one environment call ran (``env/0``) and the most calls at once
(the ``env/<k>`` lanes). And environment seconds per episode
(``episode/env_s``), turns per episode, and samples/s (whole run and
steady).

The target: with the slow tool the rollout lane stays >= 80 % busy while
generating. The script applies no settings of its own: the config's (the
example's ``async.mode: one_step``; ``environment.workers`` defaults to
``rollout.replicas x rollout.max_inflight``), then the command line's
overrides, e.g. ``async.mode=async async.max_staleness=8``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.launcher import launch  # noqa: E402
from asyncflow_core.flow.telemetry import Timeline, load_metrics, load_spans  # noqa: E402
from asyncflow_core.interfaces.environment import EnvironmentFeatures  # noqa: E402
from asyncflow_core.plugins import EnvironmentBackend, hookimpl  # noqa: E402

TARGET = 0.8  #: the rollout lane's utilisation the slow-tool run should keep while generating
BLOCKING_ENV = "guess_blocking"


# -- the blocking variant of the guess environment (registered by hand; worker processes register it too) --------


def _blocking_guess(config: Any) -> Any:
    from asyncflow_plugins.envs.guess import GuessEnvironment

    class BlockingGuess(GuessEnvironment):
        """``guess`` whose step delay is ``time.sleep`` (blocks its thread), declaring ``features.blocking``."""

        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self._features = self._features.model_copy(update={"blocking": True})

        async def step(self, action: Any) -> Any:
            start = time.perf_counter()
            lo, hi = self.config.step_delay_s
            if hi > 0:
                time.sleep(self._delays.uniform(lo, hi))  # a blocking tool: no await
            step = self._answer(action)
            return dataclasses.replace(step, info={**step.info, "tool_seconds": time.perf_counter() - start})

    return BlockingGuess(config)


@hookimpl
def asyncflow_environments():
    from asyncflow_plugins.envs.guess import GuessEnvConfig

    yield EnvironmentBackend(
        name=BLOCKING_ENV, factory=_blocking_guess, config_model=GuessEnvConfig,
        description="guess with a blocking (time.sleep) step delay (benchmarks/agent_tools.py --blocking).",
        features=EnvironmentFeatures(owns_reward=True, blocking=True),
    )


def _register_blocking_env() -> None:
    """Register this file as a plugin module under an importable name (``agent_tools``: its folder is on
    sys.path, which spawned worker processes inherit, so they import and register the same module)."""
    import importlib

    from asyncflow_core.plugins import get_plugin_manager

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    get_plugin_manager().register_module(importlib.import_module("agent_tools"), distribution="benchmarks")


# -- figures ----------------------------------------------------------------------------------------------------


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def _union(ivs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(ivs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(ivs: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in ivs if min(b, hi) > max(a, lo)]


def _gaps(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, at = [], lo
    for a, b in busy:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds two sorted, disjoint interval lists share."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _processes(env_cfg: Any) -> int | None:
    """The worker processes the run's environment pool used (the config's, or the pool's default)."""
    if env_cfg is None:
        return None
    if env_cfg.processes is not None:
        return env_cfg.processes
    from asyncflow_core.flow.env_pool import EnvironmentPool

    return EnvironmentPool.from_plugin(env_cfg.name, env_cfg.options).processes


def one_run(config: str, name: str, delay: tuple[float, float], steps: int, out: Path,
            overrides: list[str], env_name: str | None) -> dict[str, Any]:
    extra = [f"environment.name={env_name}"] if env_name else []
    cfg = load_config(config, [*overrides, *extra, f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
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
    first, last = min(s.start for s in timeline.spans), max(s.end for s in timeline.spans)
    spanned = timeline.utilisation(first, last)

    # where the decoder's idle time went (the first rollout lane; the example has one replica)
    busy = _union(_clip([(s.start, s.end) for s in decode if s.lane == lanes[0]], start, end))
    idle = _gaps(busy, start, end)
    idle_s = sum(b - a for a, b in idle)
    admission = _union(_clip([(s.start, s.end) for s in timeline.spans if s.name == "admission_wait"], start, end))
    env_on = _union(_clip([(s.start, s.end) for s in env], start, end))
    wait_batch = _union(_clip([(s.start, s.end) for s in timeline.spans if s.name == "wait_batch"], start, end))

    def share(ivs: list[tuple[float, float]]) -> float | None:
        return _overlap(idle, ivs) / idle_s if idle_s > 0 else None

    env_cfg = cfg.environment
    return {
        "run": name,
        "environment": env_cfg.name if env_cfg is not None else None,
        "step_delay_s": list(delay),
        "async": f"{cfg.async_.mode.value} k={cfg.async_.max_staleness if cfg.async_.max_staleness is not None else 1}",
        "steps": summary["steps"],
        "rollout_lanes": lanes,
        "rollout_util_generating": statistics.fmean(window.get(lane, 0.0) for lane in lanes),
        "rollout_util_spans": statistics.fmean(spanned.get(lane, 0.0) for lane in lanes),
        "rollout_util_run": statistics.fmean(summary["utilisation"][lane] for lane in lanes),
        "first_span_s": first,
        "generating_s": end - start,
        "rollout_idle_s": idle_s,
        "feeder_admission_wait": sum(b - a for a, b in admission) / (end - start),
        "idle_env_share": share(env_on),
        "train_util_generating": window.get("train", 0.0),
        "train_wait_batch_generating": sum(b - a for a, b in wait_batch) / (end - start),
        "env_busy_generating": window.get("env/0", 0.0),
        "env_calls_at_once": len({s.lane for s in env}),
        "env_s_per_episode": _mean(records, "episode/env_s"),
        "turns_per_episode": _mean(records, "episode/turns"),
        "reward_mean": _mean(records, "reward_mean"),
        "samples_per_s": summary["samples_per_s"],
        "steady_samples_per_s": summary["steady_samples_per_s"],
        "run_seconds": summary["run_seconds"],
        "max_inflight": cfg.rollout.max_inflight,
        "env_workers": (env_cfg.workers or cfg.rollout.replicas * cfg.rollout.max_inflight) if env_cfg else None,
        "env_processes": _processes(env_cfg),
        "run_dir": str(run_dir),
    }


async def _hop(episodes: int, repeats: int = 3) -> list[dict[str, float]]:
    """The worker-process hop alone: ``episodes`` guess_blocking episodes at once (no delay; open, reset, 4
    wrong guesses, close) in the pool's default worker processes; per call: wall seconds (concurrent) and this
    process's CPU seconds (all its threads)."""
    from asyncflow_core.flow.env_pool import EnvironmentPool
    from asyncflow_core.interfaces import Action

    turns = 4
    async with EnvironmentPool.from_plugin(BLOCKING_ENV, {}, workers=episodes) as pool:
        async def episode(i: int) -> None:
            async with pool.episode() as env:
                await env.reset({"prompt": "=", "answer": "9"}, seed=i)
                for t in range(turns):
                    await env.step(Action(token_ids=(), text=f"{t}.", finish_reason="stop", turn=t))

        await asyncio.gather(*[episode(i) for i in range(8)])  # start the processes first
        out = []
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            await asyncio.gather(*[episode(i) for i in range(episodes)])
            calls = episodes * (turns + 3)
            out.append({"episodes": episodes, "processes": pool.processes, "calls": calls,
                        "wall_ms_per_call": (time.perf_counter() - wall) / calls * 1e3,
                        "cpu_ms_per_call": (time.process_time() - cpu) / calls * 1e3})
        return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "agent_guess.yaml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--delay", default="0.05,0.5", help="lo,hi seconds each environment step waits")
    ap.add_argument("--blocking", action="store_true",
                    help="the wait blocks (time.sleep) in a blocking environment run in worker processes")
    ap.add_argument("--hop", type=int, default=0, metavar="EPISODES",
                    help="only time the worker-process hop: this many guess_blocking episodes at once, no run")
    ap.add_argument("--out", default="runs/agent_tools")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), applied to both runs")
    a = ap.parse_args(argv)
    try:
        lo, hi = (float(x) for x in a.delay.split(","))
    except ValueError:
        print(f"--delay wants lo,hi seconds (e.g. 0.05,0.5), got {a.delay!r}", file=sys.stderr)
        return 2
    if a.hop:
        _register_blocking_env()
        for r in asyncio.run(_hop(a.hop)):
            print(json.dumps(r) if a.json else f"{r['episodes']} episodes at once, {r['processes']} processes, "
                  f"{r['calls']} calls: {r['wall_ms_per_call']:.3f} ms/call wall, {r['cpu_ms_per_call']:.3f} ms/call "
                  "CPU in this process")
        return 0
    env_name = None
    if a.blocking:
        _register_blocking_env()
        env_name = BLOCKING_ENV
    out = Path(a.out)
    results = [one_run(a.config, "slow_tool", (lo, hi), a.steps, out, a.overrides, env_name),
               one_run(a.config, "no_delay", (0.0, 0.0), a.steps, out, a.overrides, env_name)]
    slow = results[0]
    verdict = {"target_rollout_util": TARGET, "met": slow["rollout_util_generating"] >= TARGET}
    if a.json:
        print(json.dumps({"results": results, **verdict}, indent=2))
        return 0
    cols = [("run", "run", "s"), ("async", "async", "s"), ("delay s", "step_delay_s", ""),
            ("rollout util (generating)", "rollout_util_generating", ".3f"),
            ("rollout util (spans)", "rollout_util_spans", ".3f"), ("rollout util (run)", "rollout_util_run", ".3f"),
            ("first span s", "first_span_s", ".1f"),
            ("idle with env calls", "idle_env_share", ".2f"), ("feeder admission wait", "feeder_admission_wait", ".2f"),
            ("train util", "train_util_generating", ".3f"), ("env busy (generating)", "env_busy_generating", ".3f"),
            ("env calls at once", "env_calls_at_once", "d"), ("env s/episode", "env_s_per_episode", ".3f"),
            ("turns", "turns_per_episode", ".2f"), ("samples/s", "samples_per_s", ".1f"),
            ("steady samples/s", "steady_samples_per_s", ".1f")]
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[k]) if not spec or spec == "s" else _fmt(r[k], spec)
                                for _, k, spec in cols) + " |")
    print(f"environment {slow['environment']}, max_inflight {slow['max_inflight']}, environment.workers "
          f"{slow['env_workers']}, processes {slow['env_processes']}; target rollout utilisation >= {TARGET:.0%} "
          f"while generating with the slow tool: {'met' if verdict['met'] else 'missed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
