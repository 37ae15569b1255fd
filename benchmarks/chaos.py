"""Chaos on the ray launcher: kill rollout replicas, a reward worker and the driver; count what was lost.

Usage: python benchmarks/chaos.py [--config examples/arithmetic_grpo.yaml] [--steps 60] [--kill-every 20]
                                  [--checkpoint-every 20] [--kill-driver-at STEP] [--replicas 2]
                                  [--num-cpus 4] [--out runs/chaos] [--json] [--lora] [override ...]

What it does, for real:

1. starts a loopback-only single-host Ray here (``init_local_ray``) and runs
   the config with ``launcher.name: ray`` joining it, as a separate driver
   process (``python -m asyncflow_core run``);
2. every ``--kill-every`` seconds ``ray.kill``-s one rollout replica actor
   (round robin), and once a reward worker actor; the launcher must replace
   them and lose nothing;
3. when the run has passed step ``--kill-driver-at`` and written a
   checkpoint, SIGKILLs the driver (every actor it owned dies with it);
4. resumes with ``asyncflow run --resume RUN_DIR`` (in a fresh Ray
   namespace), still killing replicas, to the end.

Then it reads the newest checkpoint's list of trained prompts and reports,
in rows (samples): ``rows_lost`` (prompts the run should have trained but did
not, times ``rollout.n``) and ``rows_duplicated`` (prompts trained more than
once), plus ``kills``, ``resumed_ok``, ``final_reward`` (mean reward of the
last five steps) and ``seconds`` (the whole benchmark's wall time).

``--lora`` runs the drill with a LoRA adapter (default config
``examples/arithmetic_grpo_lora.yaml``: adapter-only weight syncs, the
weights canary every step): killed and restarted replicas start from the
base weights and must load the newest adapter before they serve. The report
adds the canary's figures over both segments: ``canary_checks``,
``canary_flagged`` (steps whose rollout policy was not the trainer's:
a log-prob mismatch above ``canary.warn_above`` or an adapter version no
replica loaded) and ``canary_max_mean_abs_dlogp``; a flagged step fails the
drill.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncflow_core.config.loader import load_config  # noqa: E402
from asyncflow_core.flow.checkpoint import latest_checkpoint  # noqa: E402
from asyncflow_core.flow.telemetry import load_metrics  # noqa: E402


def steps_logged(run_dir: Path) -> int:
    """Step records in metrics.jsonl (a resumed run appends; the count only grows)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def checkpoint_step(run_dir: Path) -> int | None:
    """Version of the newest checkpoint, None before the first."""
    if not (run_dir / "checkpoints" / "latest").exists():
        return None
    return latest_checkpoint(run_dir)[1].version


class Killer:
    """Kills the run's actors by name, in the namespace a driver uses."""

    def __init__(self) -> None:
        import ray

        self.ray = ray
        self.kills: Counter[str] = Counter()
        self._turn = 0

    def actors(self, namespace: str, prefix: str) -> list[str]:
        named = self.ray.util.list_named_actors(all_namespaces=True)
        return sorted(a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith(prefix))

    def kill_one(self, namespace: str, prefix: str, what: str) -> str | None:
        names = self.actors(namespace, prefix)
        for _ in range(len(names)):
            name = names[self._turn % len(names)]
            self._turn += 1
            try:
                handle = self.ray.get_actor(name, namespace=namespace)
                self.ray.kill(handle, no_restart=True)
            except ValueError:
                continue  # already gone (a replaced incarnation still listed for a moment)
            self.kills[what] += 1
            return name
        return None


def segment(cmd: list[str], run_dir: Path, namespace: str, killer: Killer, a: argparse.Namespace,
            *, kill_reward: bool, kill_driver_at: int | None, log: Any) -> tuple[int, bool]:
    """Run one driver process to its end (or until it is killed); returns (exit code, killed by us)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = steps_logged(run_dir)
    next_kill = None
    reward_killed = not kill_reward
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            done = steps_logged(run_dir) - base  # steps this driver trained
            now = time.monotonic()
            if done >= 1 and next_kill is None:
                next_kill = now + a.kill_every  # kills start once the run is training
            if next_kill is not None and now >= next_kill:
                name = killer.kill_one(namespace, "rollout-", "rollout")
                if name is not None:
                    print(f"[chaos] step {done}: killed {name}", file=sys.stderr)
                next_kill = now + a.kill_every
                if not reward_killed:
                    # the reward worker goes half a period later, while the replica is being replaced
                    time.sleep(a.kill_every / 2)
                    name = killer.kill_one(namespace, "reward-", "reward")
                    print(f"[chaos] killed {name}", file=sys.stderr)
                    reward_killed = name is not None
            if kill_driver_at is not None and done >= kill_driver_at and checkpoint_step(run_dir) is not None:
                print(f"[chaos] step {done}: killing the driver (pid {proc.pid})", file=sys.stderr)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killer.kills["driver"] += 1
                return proc.returncode, True
        return proc.returncode, False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=None,
                   help="default: examples/arithmetic_grpo.yaml (with --lora: examples/arithmetic_grpo_lora.yaml)")
    p.add_argument("--lora", action="store_true", help="run the drill with a LoRA adapter (adapter-only syncs, "
                   "the canary every step)")
    p.add_argument("--steps", type=int, default=60, help="trainer.total_steps")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between rollout replica kills")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kill-driver-at", type=int, default=None, help="step after which the driver is killed "
                   "(default: half-way); it waits for a checkpoint")
    p.add_argument("--replicas", type=int, default=2, help="rollout.replicas")
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the Ray started here")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "chaos")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    a = p.parse_args(argv)
    if a.config is None:
        a.config = REPO / "examples" / ("arithmetic_grpo_lora.yaml" if a.lora else "arithmetic_grpo.yaml")
    if not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    kill_driver_at = a.kill_driver_at if a.kill_driver_at is not None else a.steps // 2
    if kill_driver_at <= a.checkpoint_every:
        p.error(f"--kill-driver-at {kill_driver_at} must come after the first checkpoint (--checkpoint-every "
                f"{a.checkpoint_every})")

    import ray

    from asyncflow_core.store.deployments.ray_store import init_local_ray, ray_listening_addresses

    t0 = time.perf_counter()
    init_local_ray(num_cpus=a.num_cpus)
    address = ray.get_runtime_context().gcs_address
    run_dir = a.out.resolve()
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    killer = Killer()
    ns1, ns2 = f"chaos-{uuid.uuid4().hex[:6]}", f"chaos-{uuid.uuid4().hex[:6]}"
    overrides = [*a.overrides, f"trainer.total_steps={a.steps}", f"trainer.checkpoint_every={a.checkpoint_every}",
                 f"rollout.replicas={a.replicas}", "launcher.name=ray",
                 f"launcher.options={{address: '{address}', namespace: {ns1}}}"]
    if a.lora:
        probe = load_config(a.config, overrides)
        if probe.trainer.lora is None:
            overrides.append("trainer.lora={}")
        if not probe.canary.every:
            overrides.append("canary.every=1")
    cfg = load_config(a.config, overrides)
    B, n = cfg.data.prompts_per_step, cfg.rollout.n
    base = [sys.executable, "-m", "asyncflow_core", "run"]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        rc1, killed = segment([*base, str(a.config), *overrides, "--run-dir", str(run_dir), "--no-progress"],
                              run_dir, ns1, killer, a, kill_reward=True, kill_driver_at=kill_driver_at, log=log)
        stopped_at = checkpoint_step(run_dir)
        rc2, _ = segment([*base, "--resume", str(run_dir), f"launcher.options.namespace={ns2}", "--no-progress"],
                         run_dir, ns2, killer, a, kill_reward=False, kill_driver_at=None, log=log)
    public = [x for x in ray_listening_addresses() if not x[0].startswith("127.")]
    ray.shutdown()
    seconds = time.perf_counter() - t0

    trained = latest_checkpoint(run_dir)[1].trained if checkpoint_step(run_dir) is not None else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    records = load_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    events: Counter[str] = Counter()
    for r in records:
        events.update(r.get("events", {}))
    last = records[-5:]
    checks = [r for r in records if "canary/flagged" in r]
    canary = {
        "canary_checks": len(checks),
        "canary_flagged": sum(1 for r in checks if r["canary/flagged"]),
        "canary_max_mean_abs_dlogp": max((r["canary/mean_abs_dlogp"] for r in checks
                                          if "canary/mean_abs_dlogp" in r), default=None),
    }
    out = {
        "lora": bool(a.lora),
        **canary,
        "kills": sum(killer.kills.values()),
        "kills_by_role": dict(killer.kills),
        "rows_lost": (a.steps * B - len(set(trained))) * n,
        "rows_duplicated": (len(trained) - len(set(trained))) * n,
        "resumed_ok": bool(killed and rc2 == 0 and summary.get("steps") == a.steps),
        "final_reward": statistics.fmean(r["reward_mean"] for r in last) if last else None,
        "final_accuracy": statistics.fmean(r["reward/correct"] for r in last) if last and "reward/correct" in last[0]
        else None,
        "seconds": round(seconds, 1),
        "steps": summary.get("steps"),
        "driver_killed_after_checkpoint": stopped_at,
        "exit_codes": [rc1, rc2],
        "ledger_after_resume": summary.get("ledger"),
        "events": {k: v for k, v in sorted(events.items()) if any(w in k for w in ("died", "restart", "requeued",
                                                                                    "retried"))},
        "non_loopback_listeners": public,
        "run_dir": str(run_dir),
    }
    ok = out["resumed_ok"] and not out["rows_lost"] and not out["rows_duplicated"] and not (
        a.lora and (out["canary_flagged"] or not out["canary_checks"]))
    if a.json:
        print(json.dumps(out))
        return 0 if ok else 1
    print("| " + " | ".join(("kills", "rows lost", "rows duplicated", "resumed", "final reward", "seconds")) + " |")
    print("|" + "---|" * 6)
    print(f"| {out['kills']} ({', '.join(f'{k} {v}' for k, v in killer.kills.items())}) | {out['rows_lost']} | "
          f"{out['rows_duplicated']} | {out['resumed_ok']} | "
          f"{out['final_reward'] if out['final_reward'] is None else round(out['final_reward'], 3)} | {seconds:.0f} |")
    print(f"events: {out['events']}")
    print(f"driver killed after the checkpoint of step {stopped_at}; run directory {run_dir}")
    if a.lora:
        print(f"LoRA: {out['canary_checks']} canary checks, {out['canary_flagged']} flagged, largest mean |dlogp| "
              f"{out['canary_max_mean_abs_dlogp']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
