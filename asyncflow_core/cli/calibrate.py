"""``asyncflow sim --calibrate RUN_DIR``: fit the sim engines' latency model to a real run, simulate its twin.

A finished run leaves its spans (``spans.jsonl``: every lane's busy time on
the run clock) and per-step metrics (``metrics.jsonl``: samples, tokens,
events, weight-sync seconds). From them this module fits the cost model of
the ``sim`` engines (docs/simulation.md) by least squares:

- **train**: ``train_step`` seconds = ``a x tokens + b`` over every step
  (tokens = prompt + response tokens of the step's batch) -> an effective
  FLOP rate and ``step_overhead_s``; ``logprobs`` passes likewise when the
  run had them;
- **rollout**: each replica's busy time (its ``generate`` spans) = ``o x
  passes + c x (prompt + generated tokens)``: ``o`` the fixed cost of one
  forward pass of the running batch (``step_overhead_s``), ``c`` the cost
  per token in it (``per_seq_s`` and ``prefill_s_per_token``). A pass
  count comes from the busy periods (each runs to the longest response of
  its requests, taken as ``max_new_tokens`` when responses reach it, as in
  the arithmetic example). One run whose passes all run the same batch
  cannot tell ``o`` from ``c``; give several runs at different batch sizes
  (``--calibrate A --calibrate B``, e.g. ``data.prompts_per_step`` halved)
  and both are fitted, else the whole cost is put on ``o`` (right for
  small models, whose passes cost the same whatever the batch) and the
  fit says so;
- **weights**: ``send_weights`` and ``update_weights`` span means;
- **lengths**: the mean response length (the sim draws lengths around it).

:func:`sim_overrides` turns a config into its simulated twin: rollout,
trainer and weight transport become ``sim`` with the fitted model, the
reward becomes ``sim`` (it reads no text; the sim engines generate none),
and everything else — data, batch sizes, bound, replicas — stays, so
``asyncflow sim CONFIG [overrides] --calibrate RUN_DIR`` predicts CONFIG.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncflow_core.errors import ConfigError

#: per-replica concurrency options of the real engines, mapped onto the sim engine's max_running_seqs
_BATCH_OPTIONS = ("max_batch", "max_num_seqs", "max_running_requests")


@dataclass
class RunRecord:
    """What one finished run tells the fit."""

    path: Path
    config: dict[str, Any]
    train_seconds: list[float]  #: per step, in step order
    train_tokens: list[int]  #: per step: prompt + response tokens trained
    forward_seconds: list[float]
    send_seconds: list[float]
    receive_seconds: list[float]
    sleep_seconds: list[float]  #: the train lane's sleep spans (colocated steps of engines that sleep)
    score_seconds: float  #: the reward lanes' score spans, summed
    wake_seconds: list[float]
    busy_durations: list[float]  #: every rollout replica's generate spans (busy periods)
    step_seconds: float  #: median width of a step
    synchronous: bool  #: async.mode sync: a step is its parts one after the other
    busy_periods: int
    requests: int  #: generations that finished (trained or not)
    generated_tokens: int
    prompt_tokens: float  #: mean per request
    max_new_tokens: int
    replicas: int
    weight_bytes: float
    steady_samples_per_s: float | None

    @property
    def period_seconds(self) -> float:
        """Median busy period of a replica (one per step and replica in a synchronous run)."""
        return statistics.median(self.busy_durations) if self.busy_durations else 0.0


def load_run(run_dir: Path) -> RunRecord:
    """Read a finished run's directory (``ConfigError`` naming what is missing)."""
    from asyncflow_core.flow.telemetry import load_metrics, load_spans

    run_dir = Path(run_dir)
    for name in ("config.yaml", "metrics.jsonl", "spans.jsonl", "summary.json"):
        if not (run_dir / name).is_file():
            raise ConfigError(f"--calibrate {run_dir}: no {name} there; give the directory of a finished run "
                              "(asyncflow run ... --run-dir DIR)")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    metrics = [m for m in load_metrics(run_dir / "metrics.jsonl") if "step" in m]
    summary = json.loads((run_dir / "summary.json").read_text())
    spans = load_spans(run_dir)

    def durations(lane_prefix: str, name: str) -> list[float]:
        return [s.end - s.start for s in sorted(spans, key=lambda s: s.start)
                if s.lane.startswith(lane_prefix) and s.name == name]

    train = durations("train", "train_step")
    tokens = [int(m["tokens"]) for m in metrics]
    if not train or len(train) != len(tokens):
        raise ConfigError(f"--calibrate {run_dir}: {len(train)} train_step spans for {len(tokens)} steps in "
                          "metrics.jsonl; calibrate from a run that finished its steps")
    generate = [s for s in spans if s.lane.startswith("rollout/") and s.name == "generate"]
    samples = sum(int(m["samples"]) for m in metrics)
    generated = sum(int(m.get("events", {}).get("tokens_generated", 0)) for m in metrics)
    started = sum(int(m.get("events", {}).get("prompts_started", 0)) for m in metrics)
    n = int(config["rollout"].get("n", 1))
    requests = max(started * n, samples)
    response_per_sample = generated / requests if requests else 0.0
    prompt = max(1.0, sum(tokens) / max(samples, 1) - response_per_sample)
    return RunRecord(
        path=run_dir, config=config, train_seconds=train, train_tokens=tokens,
        forward_seconds=[s.end - s.start for s in spans if s.lane in ("old", "ref") and s.name == "logprobs"],
        send_seconds=durations("train", "send_weights"), receive_seconds=durations("rollout/", "update_weights"),
        sleep_seconds=durations("train", "sleep"), wake_seconds=durations("train", "wake"),
        score_seconds=sum(s.end - s.start for s in spans if s.lane.startswith("reward") and s.name == "score"),
        busy_durations=[s.end - s.start for s in generate], busy_periods=len(generate), requests=requests,
        step_seconds=statistics.median(float(m["step_seconds"]) for m in metrics[1:] or metrics),
        synchronous=(config.get("async") or {}).get("mode", "sync") == "sync",
        generated_tokens=generated, prompt_tokens=prompt, max_new_tokens=int(config["rollout"]["max_new_tokens"]),
        replicas=int(config["rollout"].get("replicas", 1)),
        weight_bytes=statistics.fmean([float(m.get("weight_bytes", 0.0)) for m in metrics]) or 1.0,
        steady_samples_per_s=summary.get("steady_samples_per_s"))


@dataclass
class Calibration:
    """The fitted sim options (``rollout`` / ``trainer`` / ``weight_transport`` latency, lengths) and how well."""

    rollout: dict[str, Any]
    lengths: dict[str, Any]
    train: dict[str, Any]
    transfer: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)
    reward: dict[str, Any] = field(default_factory=dict)

    def dump(self) -> dict[str, Any]:
        return {"rollout": {"latency": self.rollout, "lengths": self.lengths}, "trainer": {"latency": self.train},
                "weight_transport": {"latency": self.transfer}, "reward": self.reward, "notes": self.notes,
                "fit": self.fit}


def _least_squares(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares for two unknowns (few rows): the full solution, or the best one-term fit."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    best: tuple[float, list[float]] | None = None
    if torch.linalg.matrix_rank(a) == a.shape[1]:
        sol = torch.linalg.lstsq(a, b).solution.squeeze(1)
        if bool((sol >= 0).all()):
            best = (float(((a @ sol.unsqueeze(1) - b) ** 2).sum()), sol.tolist())
    for j in range(a.shape[1]):  # one term only (the other 0), when the full fit is singular or negative
        col = a[:, j : j + 1]
        denom = float((col * col).sum())
        if denom <= 0:
            continue
        coef = max(0.0, float((col * b).sum()) / denom)
        sol = [0.0] * a.shape[1]
        sol[j] = coef
        err = float(((col * coef - b) ** 2).sum())
        if best is None or err < best[0] * (1 - 1e-9):
            best = (err, sol)
    assert best is not None
    return best[1]


def fit(runs: Sequence[RunRecord]) -> Calibration:
    """Fit the sim latency model to ``runs`` (see the module docstring)."""
    notes: list[str] = []
    # medians per run, not every step: on a shared machine single steps stall for seconds
    # -- train: seconds = a * tokens + b, one point per run
    xs = [statistics.median(r.train_tokens) for r in runs]
    ys = [statistics.median(r.train_seconds) for r in runs]
    spread = (max(xs) - min(xs)) / max(statistics.fmean(xs), 1.0)
    if spread < 0.2:
        a = statistics.fmean(ys) / statistics.fmean(xs)
        b = 0.0
        notes.append(f"train: the runs' batches differ by {spread:.0%} in tokens, so the per-step overhead cannot be "
                     "told from the per-token cost; all of it is per token (right for batches of this size; give "
                     "runs at two batch sizes to fit both)")
    else:
        a, b = _least_squares([[x, 1.0] for x in xs], ys)
    train = {"devices": 1, "params": 1.0, "mfu": 1.0, "peak_flops_per_device": 6.0 / max(a, 1e-15),
             "step_overhead_s": b}
    fwd = [s for r in runs for s in r.forward_seconds]
    if fwd:
        train["forward_fraction"] = 1.0
        train["forward_overhead_s"] = max(0.0, statistics.median(fwd) - a * statistics.fmean(xs))
    # -- rollout: one busy period = o * passes + c * tokens, one point per run (median period)
    rows, busy = [], []
    for r in runs:
        if not r.busy_periods:
            raise ConfigError(f"--calibrate {r.path}: no rollout generate spans; calibrate from a run that generated")
        mean_len = r.generated_tokens / max(r.requests, 1)
        if mean_len < 0.5 * r.max_new_tokens:
            notes.append(f"rollout ({r.path.name}): responses average {mean_len:.1f} of {r.max_new_tokens} tokens; the "
                         "pass count assumes every busy period runs to the cap, so the per-pass cost is a lower bound")
        tokens = (r.requests * r.prompt_tokens + r.generated_tokens) / r.busy_periods
        rows.append([float(r.max_new_tokens), float(tokens)])
        busy.append(statistics.median(r.busy_durations))
    o, c = _least_squares(rows, busy)
    if len(runs) == 1 or c == 0.0 or o == 0.0:
        notes.append("rollout: " + ("one run cannot tell" if len(runs) == 1 else "these runs did not tell")
                     + f" the per-pass cost from the per-token cost; fitted pass {o * 1e3:.3g} ms, token "
                     f"{c * 1e6:.3g} us. Calibrate from runs at two batch sizes to fit both")
    cfg = runs[0].config
    batch = next((v for k, v in (cfg["rollout"].get("options") or {}).items() if k in _BATCH_OPTIONS), None)
    # a colocated step's sleep / wake (0 when the engine never slept: the sim must not invent the cost)
    sleep = [s for r in runs for s in r.sleep_seconds]
    wake = [s for r in runs for s in r.wake_seconds]
    rollout = {"devices_per_replica": 1, "step_overhead_s": o, "weight_read_s": 0.0, "per_seq_s": c,
               "prefill_s_per_token": c, "kv_tokens_per_device": 1 << 40,
               "sleep_s": statistics.median(sleep) if sleep else 0.0,
               "wake_up_s": statistics.median(wake) if wake else 0.0,
               "wake_up_level2_s": statistics.median(wake) if wake else 0.0}
    if batch is not None:
        rollout["max_running_seqs"] = int(batch)
    mean_len = sum(r.generated_tokens for r in runs) / max(sum(r.requests for r in runs), 1)
    lengths = _fit_lengths(mean_len, min(r.max_new_tokens for r in runs))
    # -- weights
    send = [s for r in runs for s in r.send_seconds]
    recv = [s for r in runs for s in r.receive_seconds]
    nbytes = statistics.fmean([r.weight_bytes for r in runs])
    transfer = {"model_bytes": nbytes, "latency_s": 0.0,
                "send_bandwidth_bytes_per_s": nbytes / max(statistics.median(send) if send else 1e-6, 1e-6),
                "receive_bandwidth_bytes_per_s": nbytes / max(statistics.median(recv) if recv else 1e-6, 1e-6)}
    reward = {"seconds_per_sample": sum(r.score_seconds for r in runs) / max(sum(r.requests for r in runs), 1)}
    cal = Calibration(rollout, lengths, train, transfer, notes, reward=reward)
    # a synchronous step is its parts in turn: what the engines' spans leave unexplained (scoring, advantages,
    # store traffic, the host's own overhead) is the real step minus the twin's, charged to the train step
    gaps = [r.step_seconds - _simulated_step_seconds(r, cal) for r in runs if r.synchronous]
    other = max(0.0, statistics.fmean(gaps)) if gaps else 0.0
    if not gaps:
        notes.append("no synchronous run: the per-step work outside the engines (scoring, advantages, store) is not "
                     "fitted (0); calibrate from async.mode: sync runs")
    train["step_overhead_s"] = b + other
    fit_info = {
        "runs": [str(r.path) for r in runs],
        "train_s_per_token": a, "train_overhead_s": b, "other_step_s": other, "other_step_gaps_s": gaps,
        "train_median_s": ys, "train_median_tokens": xs,
        "rollout_pass_s": o, "rollout_token_s": c,
        "rollout_period_s": busy, "rollout_period_fitted_s": [o * p + c * t for p, t in rows],
        "send_s": statistics.median(send) if send else 0.0, "receive_s": statistics.median(recv) if recv else 0.0,
        "mean_response_tokens": mean_len,
    }
    cal.fit = fit_info
    return cal


def _simulated_step_seconds(run: RunRecord, cal: Calibration) -> float:
    """Median step width of ``run``'s config simulated with ``cal`` (its first 20 steps at most)."""
    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.flow.runtime import run_flow

    steps = min(20, len(run.train_seconds))
    twin = simulated_twin(run.config, cal)
    cfg = load_config(data=run.config, overrides=[*twin, "rollout.options.payload=lengths",
                                                  f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
                                                  "logging.level=WARNING"])
    ends = run_flow(resolve(cfg), virtual=True, write_png=False)["step_end_s"]
    return statistics.median(b - a for a, b in itertools.pairwise(ends)) if len(ends) > 1 else ends[0]


def _fit_lengths(mean: float, cap: int, sigma: float = 0.25) -> dict[str, float]:
    """A lognormal length model (spread ``sigma``) whose capped mean is the observed ``mean`` (bisection).

    The sim draws ``ceil`` of the lognormal quantile, capped at ``max_new_tokens``; the runs give only
    the mean, so the spread is an assumption (say so when predicting tail-sensitive placements).
    """
    normal = statistics.NormalDist()
    grid = [normal.inv_cdf((i + 0.5) / 400) for i in range(400)]

    def capped_mean(log_median: float) -> float:
        return sum(min(cap, max(1, math.ceil(math.exp(log_median + sigma * z)))) for z in grid) / len(grid)

    lo, hi = math.log(0.5), math.log(100.0 * cap)
    if capped_mean(hi) <= mean:
        return {"median_tokens": math.exp(hi), "sigma": sigma}
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid) < mean else (lo, mid)
    return {"median_tokens": math.exp((lo + hi) / 2), "sigma": sigma}


def _vocab(raw: dict[str, Any]) -> int:
    """A vocabulary size covering the prompts of config ``raw`` (the model's own when it is known)."""
    model = raw.get("model") or {}
    sizes = [int(v) for v in ((model.get("hf_config") or {}).get("vocab_size"),
                              (raw.get("rollout", {}).get("options") or {}).get("vocab_size")) if v]
    data = raw.get("data") or {}
    if data.get("name") == "sim":  # synthetic prompts: ids below the dataset's own vocabulary
        sizes.append(int((data.get("options") or {}).get("vocab_size", 32000)))
    if not sizes and model.get("path") is None and model.get("alphabet"):
        sizes.append(len(model["alphabet"]))
    return max(sizes) if sizes else 262144  # covers common tokenizers (the sim's tables are a few MB at this size)


def simulated_twin(raw: dict[str, Any], cal: Calibration) -> list[str]:
    """Overrides turning the config ``raw`` (overrides applied) into its simulated twin with ``cal``'s model."""
    rollout = dict(cal.rollout)
    real = raw.get("rollout", {}).get("options") or {}
    batch = next((v for k, v in real.items() if k in _BATCH_OPTIONS), None)
    if batch is not None:  # the predicted config's own concurrency, not the calibration run's
        rollout["max_running_seqs"] = int(batch)
    vocab = _vocab(raw)
    opts = {"rollout.options": {"latency": rollout, "lengths": cal.lengths, "vocab_size": vocab},
            "trainer.options": {"latency": cal.train, "vocab_size": vocab},
            "weight_transport.options": {"latency": cal.transfer},
            "reward.options": cal.reward}
    names = {"rollout.name": "sim", "trainer.name": "sim", "weight_transport.name": "sim", "reward.name": "sim"}
    return [f"{k}={json.dumps(v)}" for k, v in {**names, **opts}.items()]


def fit_runs(run_dirs: Sequence[Path]) -> Calibration:
    """Fit from the runs in ``run_dirs`` and write the fit to ``calibration.yaml`` in the first of them."""
    cal = fit([load_run(p) for p in run_dirs])
    out = Path(run_dirs[0]) / "calibration.yaml"
    try:
        out.write_text(yaml.safe_dump(cal.dump(), sort_keys=False))
    except OSError as exc:
        raise ConfigError(f"--calibrate: cannot write {out} ({exc.strerror}); make the run directory writable") from None
    return cal


def sim_overrides(file: Path, overrides: list[str], *, payload: str | None = None,
                  calibrate: Path | Sequence[Path] | None = None) -> list[str]:
    """The overrides ``asyncflow sim`` runs ``file`` with: its twin when calibrating, and the payload.

    The sim rollout engine returns lengths only unless ``payload`` (or the
    config) says ``tokens``.
    """
    from asyncflow_core.config.loader import apply_overrides, read_yaml

    if payload is not None and payload not in ("lengths", "tokens"):
        raise ConfigError(f"--payload {payload!r}: choose lengths (fast, the default) or tokens (full results)")
    out = list(overrides)
    raw = apply_overrides(read_yaml(file), out)
    if calibrate is not None:
        runs = [calibrate] if isinstance(calibrate, (str, Path)) else list(calibrate)
        cal = fit_runs(runs)
        from rich.console import Console

        err = Console(stderr=True, soft_wrap=True)
        err.print(f"calibrated from {', '.join(map(str, runs))} (written to {Path(runs[0]) / 'calibration.yaml'})")
        for note in cal.notes:
            err.print(f"note: {note}")
        out += simulated_twin(raw, cal)
        raw = apply_overrides(raw, out[len(overrides):])
    if raw.get("rollout", {}).get("name") == "sim":
        set_in_config = "payload" in (raw["rollout"].get("options") or {}) and payload is None
        if not set_in_config:
            out.append(f"rollout.options.payload={payload or 'lengths'}")
    return out
