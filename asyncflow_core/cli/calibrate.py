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
- **train lane**: the train stage's own work between its spans (the median
  uncovered time of a step on the ``train`` lane, in the sync runs) and the
  fetch of a ready batch (an overlapped run's ``wait_batch`` time after the
  last rows it waited for were generated or scored) are added to the train
  step's overhead: they are on the trainer's critical path in every mode;
- **weights**: ``send_weights`` and ``update_weights`` span means;
- **lengths**: the mean response length (the sim draws lengths around it);
- **driver**: what a synchronous step's engine spans leave unexplained
  (scoring, advantages, store traffic: the real step minus its twin's) per
  trained sample, charged to the sim reward (the driver's lane, before the
  train step), not to the train step;
- **host** (only from an overlapped run, ``async.mode`` one_step / async):
  how much slower the trainer's and a replica's work runs while the other
  runs beside it on the same machine. Each ``train_step`` and ``generate``
  span of the overlapped run has the work the synchronous fit gives it
  (``W``), its width and the fraction ``f`` of it overlapped by the other
  engine: ``W = width x (1 - f) + width x f x rate``; the median rate of
  each engine gives the shared host's demands and efficiency
  (:mod:`asyncflow_plugins.sim.host`). The sync runs give the costs alone,
  so base costs are fitted from them only. Replicas of an engine that serves
  from the driver's process (``torch``, ``toy`` under the local launcher)
  take turns on one thread of the host: one interpreter runs their Python.

:func:`sim_overrides` turns a config into its simulated twin: rollout,
trainer and weight transport become ``sim`` with the fitted model, the
reward becomes ``sim`` (it reads no text; the sim engines generate none),
and everything else — data, batch sizes, bound, replicas — stays, so
``asyncflow sim CONFIG [overrides] --calibrate RUN_DIR`` predicts CONFIG.
"""

from __future__ import annotations

import bisect
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
#: rollout engines whose replicas run in the driver's process under the local launcher: their Python work holds
#: one interpreter, so replicas busy at once take turns (the sim host's ``thread``); other engines serve from
#: processes of their own (vLLM's and SGLang's engine cores, Ray actors)
_IN_PROCESS_ROLLOUT = ("torch", "toy")


def _replicas_share_driver(config: dict[str, Any]) -> bool:
    """Whether ``config``'s rollout replicas run in the driver's process (one interpreter for all of them)."""
    launcher = (config.get("launcher") or {}).get("name", "local")
    return launcher == "local" and (config.get("rollout") or {}).get("name") in _IN_PROCESS_ROLLOUT


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
    train_spans: list[tuple[float, float]]  #: (start, end) of every train_step span, in step order
    generate_spans: list[tuple[float, float]]  #: (start, end) of every replica's generate spans
    update_spans: list[tuple[float, float]]  #: (start, end) of every replica's update_weights spans
    score_spans: list[tuple[float, float]]  #: (start, end) of the reward lanes' score spans
    samples: list[int]  #: per step: samples trained
    step_ends: list[float]  #: per step: its end on the run clock (the spans' clock)
    step_seconds: float  #: median width of a step
    mean_step_seconds: float  #: mean width of the steps after the first (what a rate over many steps pays)
    synchronous: bool  #: async.mode sync: a step is its parts one after the other
    busy_periods: int
    requests: int  #: generations that finished (trained or not)
    generated_tokens: int
    prompt_tokens: float  #: mean per request
    max_new_tokens: int
    replicas: int
    weight_bytes: float
    steady_samples_per_s: float | None
    #: median per step of the train lane's time outside its spans (the train stage's own work between them:
    #: concatenating the batch, the bound's check, acks, the step's event); 0 for runs without spans on it
    train_gap_seconds: float = 0.0
    #: per wait_batch span after the first: its time after the last generate or score span that ended inside
    #: it (all of it when none did: the batch was ready), i.e. fetching the batch, not waiting for it
    fetch_seconds: list[float] = field(default_factory=list)

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
        train_spans=[(s.start, s.end) for s in sorted(spans, key=lambda s: s.start)
                     if s.lane.startswith("train") and s.name == "train_step"],
        generate_spans=sorted((s.start, s.end) for s in generate), samples=[int(m["samples"]) for m in metrics],
        update_spans=sorted((s.start, s.end) for s in spans if s.lane.startswith("rollout/")
                            and s.name == "update_weights"),
        step_ends=[float(m["time_s"]) for m in metrics],
        score_spans=sorted((s.start, s.end) for s in spans if s.lane.startswith("reward") and s.name == "score"),
        step_seconds=statistics.median(float(m["step_seconds"]) for m in metrics[1:] or metrics),
        mean_step_seconds=statistics.fmean(float(m["step_seconds"]) for m in metrics[1:] or metrics),
        synchronous=(config.get("async") or {}).get("mode", "sync") == "sync",
        generated_tokens=generated, prompt_tokens=prompt, max_new_tokens=int(config["rollout"]["max_new_tokens"]),
        replicas=int(config["rollout"].get("replicas", 1)),
        weight_bytes=statistics.fmean([float(m.get("weight_bytes", 0.0)) for m in metrics]) or 1.0,
        steady_samples_per_s=summary.get("steady_samples_per_s"),
        fetch_seconds=_fetch_times([(s.start, s.end) for s in spans if s.lane == "train" and s.name == "wait_batch"],
                                   [s.end for s in spans if (s.lane.startswith("rollout/") and s.name == "generate")
                                    or (s.lane.startswith("reward") and s.name == "score")]),
        train_gap_seconds=_lane_gap([(s.start, s.end) for s in spans if s.lane == "train"],
                                    [float(m["time_s"]) for m in metrics]))


def _fetch_times(waits: list[tuple[float, float]], work_ends: list[float]) -> list[float]:
    """Per wait span after the first: the time from the last of ``work_ends`` inside it (rows generated or
    scored: what it waited for) to its end, or all of it when none is inside."""
    ends = sorted(work_ends)
    out = []
    for start, end in sorted(waits)[1:]:
        i = bisect.bisect_right(ends, end) - 1
        last = ends[i] if i >= 0 and ends[i] > start else start
        out.append(end - last)
    return out


def _merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    """``spans`` (start, end) as disjoint intervals, in order."""
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _lane_gap(spans: list[tuple[float, float]], ends: list[float]) -> float:
    """Median over the steps after the first (between consecutive step ends) of the time no span of a lane covers."""
    merged = _merged(spans)
    gaps = []
    for lo, hi in zip(ends, ends[1:]):
        covered = sum(max(0.0, min(hi, e) - max(lo, s)) for s, e in merged if s < hi and e > lo)
        gaps.append(max(0.0, hi - lo - covered))
    return statistics.median(gaps) if gaps else 0.0


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
    #: the shared host (``asyncflow_plugins.sim.host``): capacity, efficiency, and demand per engine kind
    #: (rollout, train, reward); empty when no overlapped run was given
    host: dict[str, Any] = field(default_factory=dict)

    def dump(self) -> dict[str, Any]:
        return {"rollout": {"latency": self.rollout, "lengths": self.lengths}, "trainer": {"latency": self.train},
                "weight_transport": {"latency": self.transfer}, "reward": self.reward, "host": self.host,
                "notes": self.notes, "fit": self.fit}

    def share(self, engine: str) -> dict[str, Any] | None:
        """The ``machine:`` option of the sim ``engine`` (rollout, train, reward), None without a host model."""
        if not self.host:
            return None
        out = {"name": "host", "capacity": self.host["capacity"], "efficiency": self.host["efficiency"],
               "demand": self.host["demand"][engine]}
        thread = (self.host.get("threads") or {}).get(engine)
        return {**out, "thread": thread} if thread else out


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


def fit(runs: Sequence[RunRecord], *, cores: int | None = None) -> Calibration:
    """Fit the sim latency model to ``runs`` (see the module docstring); ``cores``: the host's (default: this
    machine's, where the runs are assumed to have run)."""
    notes: list[str] = []
    sync = [r for r in runs if r.synchronous]
    overlapped = [r for r in runs if not r.synchronous]
    base = sync or list(runs)
    if not sync:
        notes.append("no synchronous run: the engines' costs alone are fitted from overlapped runs, where they "
                     "slow each other down; calibrate from async.mode: sync runs (and one overlapped run)")
    # medians per run, not every step: on a shared machine single steps stall for seconds
    # -- train: seconds = a * tokens + b, one point per run
    xs = [statistics.median(r.train_tokens) for r in base]
    ys = [statistics.median(r.train_seconds) for r in base]
    spread = (max(xs) - min(xs)) / max(statistics.fmean(xs), 1.0)
    if spread < 0.2:
        a = statistics.fmean(ys) / statistics.fmean(xs)
        b = 0.0
        notes.append(f"train: the runs' batches differ by {spread:.0%} in tokens, so the per-step overhead cannot be "
                     "told from the per-token cost; all of it is per token (right for batches of this size; give "
                     "runs at two batch sizes to fit both)")
    else:
        a, b = _least_squares([[x, 1.0] for x in xs], ys)
    # the train stage's own work between its spans is on the train lane's critical path in every mode (in a
    # synchronous step the driver fit below would take it too, but an overlapped step hides the driver's lane and
    # not this): the simulated train step carries it
    gap = statistics.median(r.train_gap_seconds for r in base)
    # and fetching its batch from the store (and the advantages folded in on the way): a wait_batch span's time
    # after the last rows it waited for were generated or scored. An overlapped run shows it (its batches are
    # mostly ready); in a synchronous run the driver fit below takes it with the rest of the step
    fetches = [f for r in overlapped for f in r.fetch_seconds]
    fetch = statistics.median(fetches) if fetches else 0.0
    gap += fetch
    train = {"devices": 1, "params": 1.0, "mfu": 1.0, "peak_flops_per_device": 6.0 / max(a, 1e-15),
             "step_overhead_s": b + gap}
    fwd = [s for r in base for s in r.forward_seconds]
    if fwd:
        train["forward_fraction"] = 1.0
        train["forward_overhead_s"] = max(0.0, statistics.median(fwd) - a * statistics.fmean(xs))
    # -- rollout: one busy period = o * passes + c * tokens, one point per run (median period)
    rows, busy = [], []
    for r in base:
        if not r.busy_periods:
            raise ConfigError(f"--calibrate {r.path}: no rollout generate spans; calibrate from a run that generated")
        mean_len = r.generated_tokens / max(r.requests, 1)
        if mean_len < 0.5 * r.max_new_tokens:
            notes.append(f"rollout ({r.path.name}): responses average {mean_len:.1f} of {r.max_new_tokens} tokens; the "
                         "pass count assumes every busy period runs to the cap, so the per-pass cost is a lower bound")
        rows.append([float(r.max_new_tokens), _period_tokens(r)])
        busy.append(statistics.median(r.busy_durations))
    o, c = _least_squares(rows, busy)
    if len(base) == 1 or c == 0.0 or o == 0.0:
        notes.append("rollout: " + ("one run cannot tell" if len(base) == 1 else "these runs did not tell")
                     + f" the per-pass cost from the per-token cost; fitted pass {o * 1e3:.3g} ms, token "
                     f"{c * 1e6:.3g} us. Calibrate from runs at two batch sizes to fit both")
    if any(r.replicas > 1 for r in sync):
        notes.append("a synchronous calibration run has several replicas: they share the host, so the fitted "
                     "rollout cost is not one replica's alone; calibrate from one-replica runs")
    cfg = runs[0].config
    batch = next((v for k, v in (cfg["rollout"].get("options") or {}).items() if k in _BATCH_OPTIONS), None)
    # a colocated step's sleep / wake (0 when the engine never slept: the sim must not invent the cost)
    sleep = [s for r in base for s in r.sleep_seconds]
    wake = [s for r in base for s in r.wake_seconds]
    rollout = {"devices_per_replica": 1, "step_overhead_s": o, "weight_read_s": 0.0, "per_seq_s": c,
               "prefill_s_per_token": c, "kv_tokens_per_device": 1 << 40,
               "sleep_s": statistics.median(sleep) if sleep else 0.0,
               "wake_up_s": statistics.median(wake) if wake else 0.0,
               "wake_up_level2_s": statistics.median(wake) if wake else 0.0}
    if batch is not None:
        rollout["max_running_seqs"] = int(batch)
    mean_len = sum(r.generated_tokens for r in base) / max(sum(r.requests for r in base), 1)
    lengths = _fit_lengths(mean_len, min(r.max_new_tokens for r in base))
    # -- weights
    send = [s for r in base for s in r.send_seconds]
    recv = [s for r in base for s in r.receive_seconds]
    nbytes = statistics.fmean([r.weight_bytes for r in base])
    transfer = {"model_bytes": nbytes, "latency_s": 0.0,
                "send_bandwidth_bytes_per_s": nbytes / max(statistics.median(send) if send else 1e-6, 1e-6),
                "receive_bandwidth_bytes_per_s": nbytes / max(statistics.median(recv) if recv else 1e-6, 1e-6)}
    cal = Calibration(rollout, lengths, train, transfer, notes, reward={"seconds_per_sample": 0.0})
    # -- driver: a synchronous step is its parts in turn; what the engines' spans leave unexplained (scoring,
    # advantages, store traffic, the host's own overhead) is the real step minus the twin's (free scoring), per
    # trained sample, charged to the reward lane: the driver's work before the train step, not the trainer's
    # (the mean step, not the median: the prediction is of a rate over many steps, and on a shared machine the
    # steps other processes stall are part of what a run pays)
    gaps = [r.mean_step_seconds - _simulated_step_seconds(r, cal) for r in sync]
    per_step = [statistics.median(r.samples) for r in sync]
    driver = max(0.0, sum(g * n for g, n in zip(gaps, per_step)) / sum(n * n for n in per_step)) if gaps else 0.0
    if gaps and driver > 0:
        driver = _match_driver(sync, cal, driver, [g for g in gaps], per_step)
    if not gaps:
        notes.append("no synchronous run: the per-step work outside the engines (scoring, advantages, store) is not "
                     "fitted (0); calibrate from async.mode: sync runs")
    cal.reward["seconds_per_sample"] = driver
    # -- host: how much the trainer and a replica slow each other down where they overlap
    host_fit: dict[str, Any] = {}
    if overlapped:
        cores = cores or _cores()
        rates_t = [x for r in overlapped for x in _overlap_rates(
            [(s, e, a * tok + b) for (s, e), tok in zip(r.train_spans, r.train_tokens)], r.generate_spans)]
        rates_r = [x for r in overlapped for x in _overlap_rates(
            [(s, e, o * r.max_new_tokens + c * _step_tokens(r)) for s, e in r.generate_spans], r.train_spans)]
        rate_t, rate_r = _median_rate(rates_t), _median_rate(rates_r)
        n_t, n_r = len(rates_t), len(rates_r)
        host_fit = {"train_rate": rate_t, "rollout_rate": rate_r, "train_spans": n_t, "rollout_spans": n_r}
        if rate_t is None and rate_r is None:
            notes.append("host: the overlapped runs have too few train_step / generate spans that overlap each other "
                         "(half their width or more) to fit the shared host; the engines stay independent")
        else:
            if rate_t is None or rate_r is None:  # e.g. short generations beside long train steps: none half overlapped
                notes.append(f"host: no {'train_step' if rate_t is None else 'generate'} span of the overlapped runs is "
                             "half overlapped by the other engine's; its rate is searched from 1 (not slowed)")
                rate_t, rate_r = rate_t or 1.0, rate_r or 1.0
            threads = {"rollout": "driver"} if _replicas_share_driver(runs[0].config) else None
            rate_t, rate_r, match = _match_host(overlapped[0], cal, rate_t, rate_r, cores, threads, gap)
            cal.host = _host_model(rate_t, rate_r, cores, threads)
            if threads:
                notes.append(f"host: the {runs[0].config['rollout']['name']} engine's replicas run in the driver's "
                             "process, so replicas busy at once take turns on its interpreter (a thread of the host)")
            host_fit.update(match, cores=cores, matched_on=str(overlapped[0].path))
            if any(r.replicas > 1 for r in overlapped):
                notes.append("host: an overlapped calibration run has several replicas; the fit treats each "
                             "overlap as the trainer beside one replica")
    else:
        notes.append("no overlapped run (async.mode one_step or async): the shared host is not fitted, so the engines "
                     "are independent; on a machine whose engines share cores give one, e.g. async.mode=one_step")
    fit_info = {
        "runs": [str(r.path) for r in runs],
        "train_s_per_token": a, "train_overhead_s": b, "train_lane_gap_s": gap, "fetch_s": fetch,
        "driver_s_per_sample": driver,
        "other_step_gaps_s": gaps,
        "train_median_s": ys, "train_median_tokens": xs,
        "rollout_pass_s": o, "rollout_token_s": c,
        "rollout_period_s": busy, "rollout_period_fitted_s": [o * p + c * t for p, t in rows],
        "send_s": statistics.median(send) if send else 0.0, "receive_s": statistics.median(recv) if recv else 0.0,
        "mean_response_tokens": mean_len, "score_s_per_sample":
            sum(r.score_seconds for r in base) / max(sum(r.requests for r in base), 1),
        "host": host_fit,
    }
    cal.fit = fit_info
    return cal


def _match_driver(sync: list[RunRecord], cal: Calibration, guess: float, gaps: list[float],
                  per_step: list[float], rounds: int = 4) -> float:
    """The per-sample driver cost whose twins' mean steps match the sync runs' (a secant on the samples-weighted
    residual, from 0 and ``guess``): scoring results as they finish overlaps the rest of a replica's busy
    period, so only part of the cost lands on the step, and the first guess (all of it) is too small."""
    def residual(x: float) -> float:
        cal.reward["seconds_per_sample"] = x
        return sum(n * (_simulated_step_seconds(r, cal) - r.mean_step_seconds) for r, n in zip(sync, per_step))

    x0, f0 = 0.0, -sum(n * g for n, g in zip(per_step, gaps))
    x1, f1 = guess, residual(guess)
    scale = sum(n * r.mean_step_seconds for r, n in zip(sync, per_step))
    for _ in range(rounds):
        if abs(f1) < 0.002 * scale or f1 == f0:
            break
        x0, f0, x1 = x1, f1, max(0.0, x1 - f1 * (x1 - x0) / (f1 - f0))
        f1 = residual(x1)
    return x1


def _period_tokens(r: RunRecord) -> float:
    """Mean prompt + generated tokens of one busy period of ``r``."""
    return (r.requests * r.prompt_tokens + r.generated_tokens) / max(r.busy_periods, 1)


def _step_tokens(r: RunRecord) -> float:
    """Prompt + generated tokens of one replica's share of a step's batch (a busy period of an overlapped run: the
    mean over its periods would count the first one, which generates the k + 1 batches of the fill)."""
    per_sample = r.prompt_tokens + r.generated_tokens / max(r.requests, 1)
    return statistics.median(r.samples) * per_sample / max(r.replicas, 1)


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _median_rate(rates: list[float]) -> float | None:
    return min(1.0, max(0.02, statistics.median(rates))) if rates else None


def _overlap_rates(spans: list[tuple[float, float, float]], others: list[tuple[float, float]],
                   min_overlap: float = 0.5) -> list[float]:
    """Rates of work during overlap, one run: each span (start, end, work alone) overlapped by ``others`` (same
    run clock) for a fraction f >= ``min_overlap`` of its width w gives ``(work - w (1 - f)) / (w f)``."""
    merged = _merged(others)
    rates = []
    for s, e, work in spans:
        width = e - s
        if width <= 0:
            continue
        inside = sum(max(0.0, min(e, me) - max(s, ms)) for ms, me in merged)
        f = inside / width
        if f >= min_overlap:
            rates.append((work - width * (1 - f)) / (width * f))
    return rates


def _match_host(run: RunRecord, cal: Calibration, rate_t: float, rate_r: float, cores: int,
                threads: dict[str, str] | None = None, gap: float = 0.0) -> tuple[float, float, dict[str, Any]]:
    """Rates (trainer, replica beside each other) whose host makes ``run``'s simulated twin reproduce its median
    ``train_step`` width (plus ``gap``: the train lane's own work per step, which the twin's train step
    carries) and its mean step (after the warm-up of k + 1), from the first guess ``rate_t, rate_r``.

    The first guess takes each span's work alone from the sync fit; but a replica's busy period of an
    overlapped run may hold several batches (the next one arrives before it is idle), weight updates land
    inside it (the sim recomputes the running batch's cache there, the torch engine in its update_weights
    span) and the driver's work overlaps both, so the guess is only a start: the trainer's rate is moved
    until its simulated steps are as wide as the real ones, then the replica's is scanned (0.25 to 1) and
    bisected where the whole step crosses the real one (the replica sets the rest of it; the step is not
    smooth in its rate), and the trainer's adjusted once more.
    """
    k = int((run.config.get("async") or {}).get("max_staleness", 1) or 1)
    real_t, real_s = _lane_widths(run.train_spans, run.step_ends, k)
    real_t += gap
    history: list[dict[str, Any]] = []

    def trial(rt: float, rr: float) -> dict[str, Any]:
        cal.host = _host_model(rt, rr, cores, threads)
        spans = _simulated_spans(run, cal, steps=min(40, len(run.train_seconds)))
        sim_t, sim_s = _lane_widths(spans["train"], spans["ends"], k)
        history.append({"train_rate": rt, "rollout_rate": rr, "train_width": [sim_t, real_t], "step": [sim_s, real_s],
                        "error": abs(math.log(sim_t / real_t)) + abs(math.log(sim_s / real_s))})
        return history[-1]

    def fit_train(rt: float, rr: float, n: int) -> float:
        prev = None
        for _ in range(n):  # a train step's width is smooth in its rate: a secant
            h = trial(rt, rr)
            if abs(h["train_width"][0] / real_t - 1) < 0.005:
                break
            rt, prev = _next_rate(rt, h["train_width"][0], real_t, prev), (rt, h["train_width"][0])
        return rt

    rate_t = fit_train(rate_t, rate_r, 4)
    # the step is not smooth in the replica's rate (which batch a weight update lands in, re-queues at the
    # bound): a scan, then a finer one around the best
    scan = [trial(rate_t, 0.25 + 0.75 * i / 7) for i in range(8)]
    # the step shortens as the replica speeds up: bisect the first pair of neighbours that bracket the real one
    pair = next(((x, y) for x, y in zip(scan, scan[1:]) if x["step"][0] >= real_s >= y["step"][0]), None)
    if pair is not None:
        lo, hi = pair[0]["rollout_rate"], pair[1]["rollout_rate"]
        for _ in range(5):
            mid = trial(rate_t, (lo + hi) / 2)
            lo, hi = (mid["rollout_rate"], hi) if mid["step"][0] >= real_s else (lo, mid["rollout_rate"])
    best = min((h for h in history if h["train_rate"] == rate_t), key=lambda h: h["error"])
    rate_r = best["rollout_rate"]
    rate_t = fit_train(rate_t, rate_r, 2)
    best = min(history, key=lambda h: h["error"])
    return best["train_rate"], best["rollout_rate"], {"rounds": history}


def _lane_widths(train: list[tuple[float, float]], ends: list[float], k: int) -> tuple[float, float]:
    """Median train_step width and mean step, over the steps after k + 1."""
    warm = k + 1
    lo, hi = (ends[warm - 1], ends[-1]) if len(ends) > warm + 1 else (ends[0], ends[-1])
    steps = max(1, sum(1 for t in ends if lo < t <= hi))
    widths = [e - s for s, e in train if s >= lo] or [e - s for s, e in train]
    return statistics.median(widths), (hi - lo) / steps


def _next_rate(rate: float, width: float, target: float, prev: tuple[float, float] | None) -> float:
    """The rate whose simulated width hits ``target``: a width is ``A + B / rate`` (work alone plus work shared),
    solved through this round and the last (``prev``: rate, width); scaled by width / target without one."""
    new = rate * width / target
    if prev is not None and prev[0] != rate and prev[1] != width:
        slope = (prev[1] - width) / (1 / prev[0] - 1 / rate)
        base = width - slope / rate
        if slope > 0 and target > base:
            new = slope / (target - base)
    return min(1.0, max(0.02, new))


def _host_model(rate_t: float, rate_r: float, cores: int, threads: dict[str, str] | None = None) -> dict[str, Any]:
    """Host options that give the trainer ``rate_t`` and a replica ``rate_r`` of their speed alone while both run.

    Rates that sum to less than 1: both keep the host busy alone (demand >= capacity), so they split it in
    proportion to their demands, and the efficiency is the sum of the two rates (what is left of the host's
    throughput). Rates that sum to 1 or more lose nothing (efficiency 1): the faster engine does not fill
    the host alone (demand below capacity: it runs at capacity / D), the slower one does (capacity / D x
    demand / capacity). The driver (reward lane) is one Python thread: one core. ``threads``: engine -> the
    host thread its busy periods take turns on (replicas in the driver's process).
    """
    cap = float(cores)
    lo_t, lo_r = min(rate_t, 1.0), min(rate_r, 1.0)
    if lo_t + lo_r < 1.0:
        eff = lo_t + lo_r
        d_t, d_r = cap * max(1.0, lo_t / lo_r), cap * max(1.0, lo_r / lo_t)
    else:
        eff = 1.0
        low, high = sorted((lo_t, lo_r))
        big, small = cap * high / low, max(1e-3 * cap, cap * (1.0 - high) / low)
        d_t, d_r = (big, small) if lo_t >= lo_r else (small, big)
    out = {"capacity": cap, "efficiency": eff, "demand": {"train": d_t, "rollout": d_r, "reward": min(1.0, cap)}}
    return {**out, "threads": dict(threads)} if threads else out


def _twin_config(run: RunRecord, cal: Calibration, steps: int) -> Any:
    from asyncflow_core.config import load_config, resolve

    twin = simulated_twin(run.config, cal)
    return resolve(load_config(data=run.config, overrides=[
        *twin, "rollout.options.payload=lengths", f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
        "trainer.export_final=false", "logging.level=WARNING"]))


def _simulated_step_seconds(run: RunRecord, cal: Calibration) -> float:
    """Mean width of the steps after the first of ``run``'s config simulated with ``cal`` (20 steps at most)."""
    from asyncflow_core.flow.runtime import run_flow

    ends = run_flow(_twin_config(run, cal, min(20, len(run.train_seconds))), virtual=True, write_png=False)["step_end_s"]
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else ends[0]


def _simulated_spans(run: RunRecord, cal: Calibration, steps: int) -> dict[str, list[tuple[float, float]]]:
    """The train_step and generate spans of ``run``'s config simulated with ``cal`` (``steps`` steps)."""
    import tempfile

    from asyncflow_core.flow.runtime import run_flow
    from asyncflow_core.flow.telemetry import load_metrics, load_spans

    with tempfile.TemporaryDirectory() as tmp:
        run_flow(_twin_config(run, cal, steps), virtual=True, run_dir=Path(tmp), write_png=False)
        spans = sorted(load_spans(Path(tmp)), key=lambda s: s.start)
        ends = [float(m["time_s"]) for m in load_metrics(Path(tmp) / "metrics.jsonl") if "step" in m]
    return {"train": [(s.start, s.end) for s in spans if s.lane.startswith("train") and s.name == "train_step"],
            "rollout": [(s.start, s.end) for s in spans if s.lane.startswith("rollout/")
                        and s.name in ("generate", "update_weights")],
            "ends": ends}


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
    opts = {"rollout.options": {"latency": rollout, "lengths": cal.lengths, "vocab_size": vocab,
                                "machine": cal.share("rollout")},
            "trainer.options": {"latency": cal.train, "vocab_size": vocab, "machine": cal.share("train")},
            "weight_transport.options": {"latency": cal.transfer},
            "reward.options": {**cal.reward, "machine": cal.share("reward")}}
    names = {"rollout.name": "sim", "trainer.name": "sim", "weight_transport.name": "sim", "reward.name": "sim"}
    return [f"{k}={json.dumps(v)}" for k, v in {**names, **opts}.items()]


def fit_runs(run_dirs: Sequence[Path], *, cores: int | None = None) -> Calibration:
    """Fit from the runs in ``run_dirs`` and write the fit to ``calibration.yaml`` in the first of them (``cores``:
    of the machine the runs ran on; default this one's)."""
    cal = fit([load_run(p) for p in run_dirs], cores=cores)
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
