"""``asyncflow plan CONFIG``: pick the staleness bound and the device placement by simulation.

The planner works on a config whose engines are the simulated ones (``sim``
rollout engine, trainer and weight transport, docs/simulation.md). For a
device budget of whole nodes it considers every

- staleness bound k = 0 .. ``max_k`` (0 is synchronous: ``async.mode: sync``),
- placement: colocated (k = 0: every device rolls out, then every device
  trains) or separated (the trainer takes whole nodes, the rest roll out),
- rollout/trainer split in whole nodes (separated),
- replicas per node (the tensor-parallel degree of a replica is the node
  size divided by it),

screens them with a closed-form step-time estimate built from the same
latency models the simulator uses, then simulates in parallel on the
virtual clock (the real runtime and store, lengths-only): the shortlist and
the best placement of every bound for one step after the warm-up, better
neighbours of the best (stepping over one worse node along the split:
:func:`beyond_worse_split`), and finally the best few over ``--steps``
steps, which rank first; with ``--start-floor`` (on by default) each
finalist with k >= 1 is also measured with ``async.start_on_step_weights``
(a prompt starts only on its step's weights: it helps some bounds and
placements and hurts others, so the planner measures it rather than
guessing). The estimate only decides what to simulate; the pick is
the simulator's. ``--full`` simulates every candidate over ``--steps`` (the
reference the screened search is checked against, docs/simulation.md).

Simulations are cut off (``--cutoff``, on by default) once their measured
steps cannot rank where they would matter: a screening run below the
``--finalists``-th best screened so far, a finalist below the best finalist
so far, a ``--full`` run below the ``--finalists``-th best so far. The rows
that decide the search and the pick are the same as without cut-offs; a
cut-off row holds an upper bound (shown ``< x``) instead of its rate.

It changes only the placement options of the sim engines
(``rollout.replicas``, ``rollout.options.latency.devices_per_replica``,
``trainer.options.latency.devices``) and ``async.*``; it reads their latency
models from the resolved options (the ``sim`` plugins' option models), so
it needs no import of the plugins.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from asyncflow_core.errors import ConfigError

#: the plugins whose options the planner knows how to change
_SIM = "sim"


# ------------------------------------------------------------------------------------------ candidates


@dataclass(frozen=True, order=True)
class Candidate:
    """One placement: a staleness bound and how the device budget is split."""

    k: int
    colocated: bool
    trainer_devices: int  #: the whole budget when colocated
    rollout_devices: int  #: the whole budget when colocated
    devices_per_replica: int  #: tensor-parallel degree of one rollout replica
    #: ``async.start_on_step_weights``: a prompt starts only on weights its step can use (k >= 1)
    start_floor: bool = False

    @property
    def replicas(self) -> int:
        return self.rollout_devices // self.devices_per_replica

    @property
    def label(self) -> str:
        where = "colocated" if self.colocated else f"{self.rollout_devices}r/{self.trainer_devices}t"
        floor = " floor" if self.start_floor else ""
        return f"k={self.k} {where} {self.replicas}x{self.devices_per_replica}{floor}"

    def overlay(self) -> dict[str, Any]:
        """The config keys this candidate sets (dotted path -> value)."""
        mode = "sync" if self.k == 0 else ("one_step" if self.k == 1 else "async")
        return {
            "async.mode": mode,
            "async.max_staleness": self.k,
            "async.colocated": self.colocated,
            "async.start_on_step_weights": self.start_floor,
            "rollout.replicas": self.replicas,
            "rollout.options.latency.devices_per_replica": self.devices_per_replica,
            "trainer.options.latency.devices": self.trainer_devices,
        }

    def overrides(self) -> list[str]:
        return [f"{key}={json.dumps(value)}" for key, value in self.overlay().items()]


def candidates(devices: int, *, node_size: int, max_k: int, replicas_per_node: Sequence[int]) -> list[Candidate]:
    """Every placement of ``devices`` (whole nodes) with k <= ``max_k``."""
    nodes = devices // node_size
    out: list[Candidate] = []
    for rpn in replicas_per_node:
        dpr = node_size // rpn
        out.append(Candidate(0, True, devices, devices, dpr))
        for t in range(1, nodes):
            for k in range(max_k + 1):
                out.append(Candidate(k, False, t * node_size, devices - t * node_size, dpr))
    return out


def floor_variants(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with k >= 1 again, with ``async.start_on_step_weights`` (at k = 0 it changes nothing: a
    synchronous step starts every prompt on the newest weights)."""
    return [replace(c, start_floor=True) for c in cands if c.k >= 1 and not c.start_floor]


def neighbours(c: Candidate, *, devices: int, node_size: int, max_k: int,
               replicas_per_node: Sequence[int]) -> list[Candidate]:
    """Candidates one step away: the bound +-1, one node moved between the sides, the next replica size."""
    out = []
    rpns = sorted(replicas_per_node)
    here = rpns.index(node_size // c.devices_per_replica)
    sizes = [node_size // rpns[i] for i in (here - 1, here + 1) if 0 <= i < len(rpns)]
    if c.colocated:
        out += [Candidate(0, True, devices, devices, d) for d in sizes]
        return out
    for k in (c.k - 1, c.k + 1):
        if 0 <= k <= max_k:
            out.append(Candidate(k, False, c.trainer_devices, c.rollout_devices, c.devices_per_replica))
    for dt in (c.trainer_devices - node_size, c.trainer_devices + node_size):
        if node_size <= dt <= devices - node_size:
            out.append(Candidate(c.k, False, dt, devices - dt, c.devices_per_replica))
    out += [Candidate(c.k, False, c.trainer_devices, c.rollout_devices, d) for d in sizes]
    return out


# -------------------------------------------------------------------------------------- the analytic screen


@dataclass
class Workload:
    """What the closed-form estimate needs, read once from the resolved config."""

    samples: int  #: samples per step (prompts_per_step x n)
    prompt_tokens: float  #: mean prompt length
    response_tokens: float  #: mean response length, capped
    longest: float  #: expected longest response of a step
    max_running: int
    max_inflight: int
    rollout: Any  #: the sim rollout engine's latency model (a RolloutLatency)
    train: Any  #: the sim trainer's latency model (a TrainLatency)
    transfer_s: float  #: one send plus one receive of a weight version


def workload(resolved: Any) -> Workload:
    """The workload of a resolved sim config (``ConfigError`` unless its engines are the sim ones)."""
    cfg = resolved.config
    names = {"rollout": cfg.rollout.name, "trainer": cfg.trainer.name, "weight_transport": cfg.weight_transport.name}
    other = {k: v for k, v in names.items() if v != _SIM}
    if other:
        raise ConfigError(
            f"asyncflow plan simulates configs on the sim engines; {', '.join(f'{k}: {v}' for k, v in other.items())} "
            "is not. Set rollout.name, trainer.name and weight_transport.name to sim (examples/sim_7b.yaml), or "
            "calibrate the sim engines from a real run first (asyncflow sim --calibrate RUN_DIR)")
    ro = resolved.components["rollout"].options
    tr = resolved.components["trainer"].options
    wt = resolved.components["weight_transport"].options
    dataset = resolved.components["data"].create()
    count = min(len(dataset), 512)
    prompt = sum(len(dataset[i].prompt_token_ids) or 1 for i in range(count)) / max(count, 1)
    cap = cfg.rollout.max_new_tokens
    lengths = ro.lengths
    grid = 2000
    mean = sum(min(lengths.quantile((i + 0.5) / grid), cap) for i in range(grid)) / grid
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    longest = min(cap, lengths.quantile(1 - 1 / (samples + 1)))
    return Workload(samples, prompt, mean, longest, ro.latency.max_running_seqs, cfg.rollout.max_inflight, ro.latency,
                    tr.latency, wt.latency.send_time() + wt.latency.receive_time())


def _rollout_seconds(w: Workload, c: Candidate, *, per_step_batch: bool) -> tuple[float, float]:
    """(throughput seconds, tail seconds) of one step's samples on the candidate's replicas."""
    lat = w.rollout.model_copy(update={"devices_per_replica": c.devices_per_replica})
    per_replica = w.samples / c.replicas
    full = max(1, min(w.max_running, w.max_inflight,
                      int(lat.kv_capacity_tokens // (w.prompt_tokens + w.response_tokens))))
    window = per_replica * (1 if per_step_batch else c.k + 1)
    batch = max(1.0, min(full, window))
    work = per_replica * (w.response_tokens / lat.decode_throughput(batch) + lat.prefill_time(w.prompt_tokens))
    # the longest response decodes beside the others: k = 0 drains the replica as its step ends (a quarter of its
    # share left, say), while k >= 1 keeps admitting the next steps' prompts, so the batch stays at its window and
    # the tail decodes at that batch's step time (1-device replicas at k >= 1 read ~2x fast without this: issue 19)
    tail_batch = min(batch, per_replica / 4) if per_step_batch else batch
    tail = w.longest * lat.step_time(max(1.0, tail_batch))
    return work, tail


def estimate_step_seconds(w: Workload, c: Candidate) -> float:
    """A closed-form step time: rollout then training for k = 0, the slower of the two overlapped for k >= 1."""
    tokens = w.samples * (w.prompt_tokens + w.response_tokens)
    train = w.train.model_copy(update={"devices": c.trainer_devices}).train_time(int(tokens)) + w.transfer_s
    work, tail = _rollout_seconds(w, c, per_step_batch=c.k == 0)
    if c.k == 0:
        roll = max(work, tail)
        extra = w.rollout.sleep_s + w.rollout.wake_up_s if c.colocated else 0.0
        return roll + train + extra
    # overlapped: a tail longer than k + 1 steps is re-queued and redone, a cost the throughput pays
    step = max(train, work)
    if tail > (c.k + 1) * step:
        step = max(step, tail / (c.k + 1))
    return step


def ideal_samples_per_s(w: Workload, devices: int, node_size: int) -> float:
    """A bound no placement beats: every device doing only modelled work, perfectly overlapped or time-shared.

    Rollout decodes at the largest batch a replica can run (no tail, no
    idle replica, one device per replica), training costs ``train_time`` of
    the step's tokens; a step takes the better of (a) the two overlapped on
    the best split in whole nodes and (b) every device rolling out, then
    every device training (time-sharing, nothing else). So
    ``efficiency_vs_ideal`` is at most 1.
    """
    tokens = int(w.samples * (w.prompt_tokens + w.response_tokens))
    lat = w.rollout.model_copy(update={"devices_per_replica": 1})
    full = max(1, min(w.max_running, int(lat.kv_capacity_tokens // (w.prompt_tokens + w.response_tokens))))
    per_device = w.response_tokens / lat.decode_throughput(full) + lat.prefill_time(w.prompt_tokens)

    def train(dt: int) -> float:
        return w.train.model_copy(update={"devices": dt}).train_time(tokens)

    best = w.samples * per_device / devices + train(devices)
    for t in range(1, devices // node_size):
        dt = t * node_size
        best = min(best, max(w.samples * per_device / (devices - dt), train(dt)))
    return w.samples / best


def work_bound_samples_per_s(w: Workload, c: Candidate) -> float:
    """Samples/s of ``c`` if its replicas decoded at the largest batch they may run and nothing else cost time.

    Rollout: the step's samples at the mean (capped) response length, decoded at the batch of
    ``min(max_running_seqs, max_inflight)`` with their prompts' prefill, shared evenly over the replicas (no tail,
    no idle replica, no wasted tokens); training: ``train_time`` of the step's tokens. k = 0 does the two one after
    the other (the next rollout needs the new weights), k >= 1 overlaps them. Looser than
    :func:`estimate_step_seconds` and meant as a ceiling for pruning a reference sweep (benchmarks/plan_check.py
    ``--bounded-sweep``): it is a bound on modelled work at the *mean* length, not a strict bound on one finite
    sample of lengths (whose mean differs by ~1-2 % at thousands of samples per step), hence that sweep's margin.
    """
    lat = w.rollout.model_copy(update={"devices_per_replica": c.devices_per_replica})
    batch = max(1, min(w.max_running, w.max_inflight))
    roll = w.samples * (w.response_tokens / lat.decode_throughput(batch) + lat.prefill_time(w.prompt_tokens))
    roll /= c.replicas
    tokens = int(w.samples * (w.prompt_tokens + w.response_tokens))
    train = w.train.model_copy(update={"devices": c.trainer_devices}).train_time(tokens)
    return w.samples / (roll + train if c.k == 0 else max(roll, train))


# ------------------------------------------------------------------------------------------- simulation


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # the pool runs one simulation per core


#: the stop reason of a simulation cut off by its floor (see :func:`simulate`)
_CUT = "plan: cut off below the floor"
#: the stop reason of a simulation halted once its measured steps ended (the horizon past them is never run)
_DONE = "plan: measured steps done"
#: virtual seconds a simulation runs past the time its floor allows before it is cut (covers the rounding of
#: step ends to microseconds in the summary, so a cut-off row is always strictly below its floor)
_CUT_SLACK_S = 1e-3


def simulate(raw: dict[str, Any], overrides: list[str], cand: Candidate, measured_steps: int,
             floor: float | None = None) -> dict[str, Any]:
    """Simulate one candidate: ``k + 1`` warm-up steps, then ``measured_steps``; returns its table row.

    The run is configured for ``k + 1`` steps past the measured ones and halted as the last measured step ends,
    so the measured steps run as inside a longer run (a run's last steps drain; docs/simulation.md, "Planning").

    ``floor`` (samples/s): stop the simulation as soon as its measured steps cannot reach it (their virtual
    time passed ``measured_steps`` x samples per step / ``floor``); the row is then marked ``cut_off`` and its
    ``samples_per_s`` is an upper bound below the floor (the rate had it ended at the cut). Everything before
    the cut runs as without a floor: the cut-off only reads the context (a subscriber and one timer).
    Runs in a worker process (top-level, picklable arguments).
    """
    import asyncio

    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.flow.clock import run_virtual
    from asyncflow_core.flow.events import VersionPublished
    from asyncflow_core.flow.runtime import FlowRuntime
    from asyncflow_core.flow.stage import RunStopped

    warm = cand.k + 1
    # the run is told of k + 1 steps past the measured ones and halted once those are measured: a run's last steps
    # have no later prompts to take the place of their long groups (the prompts are capped at total_steps x B), so
    # they drain; measured, they read a step as slow as a whole rollout (docs/simulation.md, "Planning")
    horizon = cand.k + 1
    cfg = load_config(data=raw, overrides=[*overrides, *cand.overrides(),
                                           f"trainer.total_steps={warm + measured_steps + horizon}",
                                           "rollout.options.payload=lengths", "trainer.checkpoint_every=0",
                                           "logging.level=WARNING"])
    per_step = cfg.data.prompts_per_step * cfg.rollout.n
    cut: dict[str, float] = {}

    def watch(ctx: Any) -> None:
        loop = asyncio.get_running_loop()
        allowed = measured_steps * per_step / floor + _CUT_SLACK_S if floor is not None else 0.0

        def stop_if_short() -> None:
            if ctx.version < warm + measured_steps and not ctx.stop.is_set():
                cut["at"] = loop.time()
                ctx.halt(_CUT)

        def published(ev: VersionPublished) -> None:
            if ev.version == warm + measured_steps and not ctx.stop.is_set():  # measured: the horizon is not run
                ctx.halt(_DONE)
            if floor is not None and ev.version == warm:  # the warm-up's last step ended: measured steps start
                cut["from"] = loop.time()
                loop.call_at(cut["from"] + allowed, stop_if_short)

        ctx.events.subscribe(VersionPublished, published, name="plan-cutoff")

    roles = _capture()
    runtime = FlowRuntime(resolve(cfg), write_png=False, roles=roles, on_start=watch)
    t0 = time.perf_counter()
    try:
        summary = run_virtual(runtime.run())
    except RunStopped as exc:
        if "at" not in cut and _DONE not in str(exc):
            raise
        summary = runtime.summary
    finally:
        del runtime
    wall = time.perf_counter() - t0
    ends = summary["step_end_s"]
    if "at" in cut:
        steady = measured_steps * per_step / (cut["at"] - cut["from"])
    else:
        steady = (len(ends) - warm) * per_step / (ends[-1] - ends[warm - 1]) if len(ends) > warm else 0.0
    generated = sum(e.stats.tokens_generated for s, e in roles.built if s == "rollout")
    del roles
    # a run leaves its whole object graph (store arenas, engines, the context) as cyclic garbage, which the
    # collector's oldest generation reaches only now and then: a worker that simulates placement after placement
    # grew by ~150 MB a simulation (12 GB in a 128-device full sweep) until this collection
    gc.collect()
    delivered = int(summary["counters"].get("tokens_generated", 0))
    hist = {int(k): v for k, v in summary["staleness_histogram"].items()}
    trained = sum(hist.values())
    util = summary["utilisation"]
    rollout_util = [v for lane, v in util.items() if lane.startswith("rollout/")]
    return {
        "candidate": asdict(cand),
        "label": cand.label,
        "measured_steps": measured_steps,
        "samples_per_s": steady,
        "sim_seconds": summary["run_seconds"],
        "steps": summary["steps"],
        "staleness_histogram": hist,
        "mean_staleness": sum(k * v for k, v in hist.items()) / trained if trained else 0.0,
        "violations": sum(v for k, v in hist.items() if k > cand.k),
        "requeued_groups": sum(v for k, v in summary["ledger"].items() if k.startswith("requeued")),
        "dropped_groups": summary["ledger"].get("dropped", 0),
        "aborted_tokens": max(0, generated - delivered),
        "aborted_fraction": (generated - delivered) / generated if generated else 0.0,
        "rollout_utilisation": sum(rollout_util) / len(rollout_util) if rollout_util else 0.0,
        "train_utilisation": util.get("train", 0.0),
        "wall_s": wall,
        "cut_off": "at" in cut,
    }


def _capture() -> Any:
    """Roles that build everything in this process, like the local launcher, and keep the engines for stats."""
    from asyncflow_core.flow.runtime import Roles

    class Capture(Roles):
        def __init__(self) -> None:
            super().__init__()
            self.built: list[tuple[str, Any]] = []

        def build(self, section: str, factory: Any, options: Any, *, role: str, index: int = 0) -> Any:
            obj = factory(options)
            self.built.append((section, obj))
            return obj

    return Capture()


# ------------------------------------------------------------------------------------------ the search


@dataclass
class PlanResult:
    """Everything ``asyncflow plan`` found: simulated rows (ranked), the pick, how long it took."""

    rows: list[dict[str, Any]]
    chosen: dict[str, Any]
    ideal_samples_per_s: float
    candidates: int
    simulated: int
    wall_s: float
    settings: dict[str, Any] = field(default_factory=dict)


def run_plan(config: Path, overrides: Sequence[str] = (), *, devices: int | None = None, node_size: int = 8,
             max_k: int = 4, replicas_per_node: Sequence[int] = (1, 2, 4, 8), measured_steps: int = 3,
             shortlist: int = 8, finalists: int = 3, full: bool = False, workers: int | None = None,
             progress: bool = True, cutoff: bool = True, start_floor: bool = True) -> PlanResult:
    """Screen, simulate and rank the placements of ``config`` (see the module docstring)."""
    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.config.loader import read_yaml

    t0 = time.perf_counter()
    raw = read_yaml(config)
    resolved = resolve(load_config(config, list(overrides)))
    w = workload(resolved)
    if devices is None:
        lat = resolved.components["rollout"].options.latency
        devices = resolved.config.rollout.replicas * lat.devices_per_replica
        if not resolved.config.async_.colocated:
            devices += resolved.components["trainer"].options.latency.devices
    bad_rpn = [r for r in replicas_per_node if r < 1 or node_size % r]
    if devices < 2 * node_size or devices % node_size:
        raise ConfigError(f"--devices {devices}: give a multiple of the node size {node_size}, at least two nodes "
                          "(the trainer and the rollout each take whole nodes)")
    if bad_rpn:
        raise ConfigError(f"--replicas-per-node {bad_rpn}: each must divide the node size {node_size}")
    if max_k < 0:
        raise ConfigError(f"--max-staleness {max_k}: the bound is >= 0 (0 is synchronous)")
    if measured_steps < 1:
        raise ConfigError(f"--steps {measured_steps}: measure at least one step after the warm-up")
    store_cap = getattr(resolved.components["store"].options, "capacity", None)
    need = (max_k + 2) * w.samples
    if store_cap is not None and store_cap < need:
        raise ConfigError(f"store.options.capacity={store_cap} cannot hold the rows of k={max_k} "
                          f"((k + 2) x {w.samples}); raise it to {need} or lower --max-staleness")
    space = {"devices": devices, "node_size": node_size, "max_k": max_k,
             "replicas_per_node": tuple(replicas_per_node)}
    every = candidates(**space)
    variants = floor_variants(every) if start_floor else []
    estimate = {c: estimate_step_seconds(w, c) for c in every}
    estimate.update({v: estimate[replace(v, start_floor=False)] for v in variants})  # the floor is not in it
    jobs = max(1, workers or os.cpu_count() or 1)
    with _Runner(raw, list(overrides), jobs, progress) as runner:
        if full:
            done = runner.run(every + variants, measured_steps, keep=finalists if cutoff else None)
        else:
            done = _search(runner, every, estimate, space, shortlist=shortlist, finalists=finalists,
                           measured_steps=measured_steps, cutoff=cutoff, start_floor=start_floor)
    ideal = ideal_samples_per_s(w, devices, node_size)
    # placements measured over every step first (the finalists), then those only screened
    rows = sorted(done.values(), key=lambda r: (-r["measured_steps"], -r["samples_per_s"], r["candidate"]["k"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
        r["efficiency_vs_ideal"] = r["samples_per_s"] / ideal
        r["estimate_samples_per_s"] = w.samples / estimate[Candidate(**r["candidate"])]
    return PlanResult(rows=rows, chosen=rows[0], ideal_samples_per_s=ideal, candidates=len(every) + len(variants),
                      simulated=len(done), wall_s=time.perf_counter() - t0,
                      settings={**space, "replicas_per_node": list(replicas_per_node), "measured_steps": measured_steps,
                                "full": full, "cutoff": cutoff, "start_floor": start_floor, "workers": jobs,
                                "config": str(config),
                                "overrides": list(overrides)})


def _search(runner: _Runner, every: list[Candidate], estimate: dict[Candidate, float], space: dict[str, Any], *,
            shortlist: int, finalists: int, measured_steps: int, cutoff: bool,
            start_floor: bool = False) -> dict[Candidate, dict[str, Any]]:
    """Screened search: simulate the analytic shortlist for one step after the warm-up, walk to better
    neighbours (for up to ``_WALK_ROUNDS`` moves; along the split it steps over one worse node, see
    :func:`beyond_worse_split`), then measure the best few over ``measured_steps`` and keep those rows for them;
    with ``start_floor``, measure those with k >= 1 again with ``async.start_on_step_weights``
    (:func:`floor_variants`; cut off, with ``cutoff``, once one cannot beat the best finalist).

    With ``cutoff``, a screening simulation stops once it cannot enter the best ``finalists`` screened so far,
    and a finalist once it cannot beat the best finalist so far (:meth:`_Runner.run`): the walk (which starts
    from the best), the finalists and the pick are the same as without it; only the rows cut off hold upper
    bounds instead of their rates."""
    keep = finalists if cutoff else None

    def exact() -> list[float]:
        return [r["samples_per_s"] for r in seen.values() if not r["cut_off"]]

    def rate(c: Candidate) -> float:
        return seen[c]["samples_per_s"]

    def screen(cands: list[Candidate]) -> None:
        fresh = [c for c in dict.fromkeys(cands) if c not in seen]
        if fresh:
            seen.update(runner.run(fresh, 1, keep=keep, known=exact()))

    ranked = sorted(every, key=lambda c: estimate[c])
    seen = runner.run(list(dict.fromkeys(ranked[:shortlist] + _best_per_group(ranked))), 1, keep=keep)
    for _ in range(_WALK_ROUNDS):  # walk to better neighbours of the best screened placement
        best = max(seen, key=rate)
        # two nodes out along the split too, unless the node between is known to read better (the walk moves there)
        screen(neighbours(best, **space) + beyond_worse_split(best, seen, rate, node_size=space["node_size"]))
        if max(seen, key=rate) == best:
            break
    top = sorted(seen, key=lambda c: -rate(c))[:finalists]
    seen.update(runner.run(top, measured_steps, keep=1 if cutoff else None))
    if start_floor:
        best = [seen[c]["samples_per_s"] for c in top if not seen[c]["cut_off"]]
        seen.update(runner.run(floor_variants(top), measured_steps, keep=1 if cutoff else None, known=best))
    return seen


#: rounds of the walk at most (each moves to a better screened placement or ends the walk)
_WALK_ROUNDS = 2


def beyond_worse_split(c: Candidate, seen: dict[Candidate, Any], rate: Any, *, node_size: int) -> list[Candidate]:
    """The placements two nodes along the split from ``c`` on each side, unless the one node between them was
    screened (in ``seen``) and reads at least ``c`` (``rate``): the walk steps over one worse split neighbour.
    They are screened in the same batch as ``c``'s neighbours (that node's rate unknown yet), so the step over
    adds no round of simulations, only at most two simulations per move.

    Along the split the measure moves in steps, not smoothly: a node more for rollout changes the replica count
    and so how a step's groups divide over the replicas, which of them outlive their window and are re-queued,
    and the warm-up transient (issue 19 at 128 devices, k = 4, 8-device replicas, 3 steps: 64r 102.4, 72r 90.5,
    80r 121.8). One worse node is within that noise; two in a row end the walk along that side."""
    if c.colocated:
        return []
    out = []
    for side in (-1, 1):
        near, far = (Candidate(c.k, False, c.trainer_devices - side * m * node_size,
                               c.rollout_devices + side * m * node_size, c.devices_per_replica) for m in (1, 2))
        if ((near not in seen or rate(near) < rate(c)) and far.trainer_devices >= node_size
                and far.rollout_devices >= node_size):
            out.append(far)
    return [f for f in out if f not in seen]


def _best_per_group(ranked: list[Candidate]) -> list[Candidate]:
    """The best-estimated placement of every (k, colocated) pair: the screen must not rule out a bound."""
    seen: set[tuple[int, bool]] = set()
    out = []
    for c in ranked:
        if (c.k, c.colocated) not in seen:
            seen.add((c.k, c.colocated))
            out.append(c)
    return out


def longest_first(cands: Sequence[Candidate], steps: int) -> list[Candidate]:
    """``cands`` in the order to start them: the most simulated steps (k + 1 warm-up + ``steps``) first, then the
    most replicas (more events), so a round of simulations does not end on one long run while the other workers
    idle. The order changes no result: each simulation is deterministic, and rows come back in the order asked."""
    return sorted(dict.fromkeys(cands), key=lambda c: (-(c.k + 1 + steps), -c.replicas))


def cheapest_first(cands: Sequence[Candidate], steps: int) -> list[Candidate]:
    """``cands`` in the order to start them when simulations may be cut off: the fewest simulated steps first
    (then the most replicas), so that the floors the later ones are cut at are known early."""
    return sorted(dict.fromkeys(cands), key=lambda c: (c.k + 1 + steps, -c.replicas))


class _Runner:
    """A process pool over every core with one progress bar for the whole plan."""

    def __init__(self, raw: dict[str, Any], overrides: list[str], jobs: int, progress: bool,
                 pool: Any = None) -> None:
        self.raw, self.overrides, self.jobs, self.show = raw, overrides, jobs, progress
        self.pool = pool  #: an executor to run on instead (tests); None: a process pool of ``jobs``

    def __enter__(self) -> _Runner:  # noqa: PYI034 - a private class, never subclassed
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker)
        self.bar = Progress(TextColumn("[bold]plan"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), disable=not self.show, transient=True)
        self.bar.start()
        self.task = self.bar.add_task("", total=0)
        return self

    def run(self, cands: list[Candidate], steps: int, *, keep: int | None = None,
            known: Sequence[float] = ()) -> dict[Candidate, dict[str, Any]]:
        """Simulate ``cands`` (``steps`` measured steps each) on the pool; their rows by candidate.

        ``keep``: only the ``keep`` best rates matter (with ``known``, the exact rates of rows measured over
        ``steps`` before): each simulation starts with a floor, the ``keep``-th best rate known when it starts,
        and is cut off once it cannot reach it (:func:`simulate`); a cut-off rate is below every rate in the
        ``keep`` best, so the ``keep`` best are those without cut-offs. The cheapest simulations start first then,
        so that floors are known early. Simulations start one per free worker.
        """
        from concurrent.futures import FIRST_COMPLETED, wait

        self.bar.update(self.task, total=(self.bar.tasks[0].total or 0) + len(cands))
        order = longest_first(cands, steps) if keep is None else cheapest_first(cands, steps)
        rates = sorted(known, reverse=True)
        futures: dict[Any, Candidate] = {}
        done: dict[Candidate, dict[str, Any]] = {}

        def start_next() -> None:
            if order:
                c = order.pop(0)
                floor = rates[keep - 1] if keep is not None and len(rates) >= keep else None
                futures[self.pool.submit(simulate, self.raw, self.overrides, c, steps, floor)] = c

        for _ in range(self.jobs):
            start_next()
        while futures:
            finished, _ = wait(futures, return_when=FIRST_COMPLETED)
            for fut in finished:
                c = futures.pop(fut)
                row = done[c] = fut.result()
                if not row["cut_off"]:
                    rates = sorted([*rates, row["samples_per_s"]], reverse=True)
                note = "cut off" if row["cut_off"] else f"{row['samples_per_s']:.1f} samples/s"
                self.bar.update(self.task, advance=1, description=f"{c.label}: {note}")
                start_next()
        return {c: done[c] for c in cands}

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
        self.pool.shutdown(cancel_futures=True)


# --------------------------------------------------------------------------------------------- outputs


def _histogram_text(hist: dict[int, int]) -> str:
    total = sum(hist.values()) or 1
    return " ".join(f"{k}:{v / total:.0%}" for k, v in sorted(hist.items()))


def print_table(result: PlanResult, console: Any, limit: int = 20) -> None:
    """The ranked table (best first)."""
    from rich.table import Table

    table = Table(title=f"asyncflow plan: {result.settings['devices']} devices, {result.simulated} of "
                        f"{result.candidates} placements simulated; ideal {result.ideal_samples_per_s:.1f} samples/s")
    for col in ("#", "k", "placement", "replicas x TP", "samples/s", "steps", "vs ideal", "re-queued",
                "aborted tokens", "staleness", "roll/train busy"):
        table.add_column(col, justify="right" if col not in ("placement", "staleness") else "left")
    for r in result.rows[:limit]:
        c = r["candidate"]
        where = "colocated" if c["colocated"] else f"{c['rollout_devices']} roll / {c['trainer_devices']} train"
        where += ", start floor" if c.get("start_floor") else ""
        table.add_row(str(r["rank"]), str(c["k"]), where, f"{c['rollout_devices'] // c['devices_per_replica']} x "
                      f"{c['devices_per_replica']}",
                      f"< {r['samples_per_s']:.1f}" if r.get("cut_off") else f"{r['samples_per_s']:.1f}",
                      str(r["measured_steps"]),
                      f"{r['efficiency_vs_ideal']:.2f}",
                      str(r["requeued_groups"]), f"{r['aborted_fraction']:.1%}", _histogram_text(r["staleness_histogram"]),
                      f"{r['rollout_utilisation']:.2f} / {r['train_utilisation']:.2f}")
    console.print(table)


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows no other row beats on both throughput (higher) and mean staleness (lower); rows cut off (an upper
    bound on throughput, the staleness of a part of the run) are left out."""
    front: list[dict[str, Any]] = []
    exact = (r for r in rows if not r.get("cut_off"))
    for r in sorted(exact, key=lambda r: (r["mean_staleness"], -r["samples_per_s"])):
        if not front or r["samples_per_s"] > front[-1]["samples_per_s"]:
            front.append(r)
    return front


def pareto_png(result: PlanResult, path: Path) -> Path:
    """Throughput against mean staleness of every simulated placement; the Pareto front and the pick marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for colocated, marker in ((False, "o"), (True, "s")):
        pts = [r for r in result.rows if r["candidate"]["colocated"] == colocated and not r.get("cut_off")]
        if pts:
            ax.scatter([r["mean_staleness"] for r in pts], [r["samples_per_s"] for r in pts], marker=marker,
                            c=[r["candidate"]["k"] for r in pts], cmap="viridis", vmin=0,
                            vmax=max(1, result.settings["max_k"]), alpha=0.8,
                            label="colocated" if colocated else "separated")
    front = pareto_front(result.rows)
    ax.plot([r["mean_staleness"] for r in front], [r["samples_per_s"] for r in front], "k--", lw=1,
            label="Pareto front")
    best = result.chosen
    ax.scatter([best["mean_staleness"]], [best["samples_per_s"]], s=200, facecolors="none", edgecolors="red",
               label=f"pick: {best['label']}")
    ax.axhline(result.ideal_samples_per_s, color="grey", lw=0.8, ls=":", label="ideal bound")
    ax.set_xlabel("mean staleness of trained samples (versions)")
    ax.set_ylabel("steady samples/s (simulated)")
    ax.set_title(f"asyncflow plan: {result.settings['devices']} devices")
    fig.colorbar(ax.collections[0], ax=ax, label="k (bound)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(result: PlanResult, out: Path) -> dict[str, Path]:
    """plan.json, pareto.png, overlay.yaml (the pick's keys) and chosen.yaml (the whole config with them)."""
    from asyncflow_core.config.loader import apply_overrides, read_yaml

    out.mkdir(parents=True, exist_ok=True)
    cand = Candidate(**result.chosen["candidate"])
    nested: dict[str, Any] = {}
    for key, value in cand.overlay().items():
        node = nested
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    head = (f"# asyncflow plan {result.settings['config']}: pick {cand.label}, "
            f"{result.chosen['samples_per_s']:.2f} samples/s simulated "
            f"({result.chosen['efficiency_vs_ideal']:.2f} of the ideal)\n")
    files = {"overlay": out / "overlay.yaml", "chosen": out / "chosen.yaml", "json": out / "plan.json",
             "png": out / "pareto.png"}
    files["overlay"].write_text(head + "# apply: asyncflow run CONFIG " + " ".join(cand.overrides()) + "\n"
                                + yaml.safe_dump(nested, sort_keys=False))
    base = apply_overrides(read_yaml(Path(result.settings["config"])), result.settings["overrides"])
    files["chosen"].write_text(head + yaml.safe_dump(apply_overrides(base, cand.overrides()), sort_keys=False))
    files["json"].write_text(json.dumps(asdict(result), indent=1, default=str))
    pareto_png(result, files["png"])
    return files


# ------------------------------------------------------------------------------------------------ CLI


def plan_cmd(
    config: Annotated[Path, typer.Argument(help="YAML run config on the sim engines (e.g. examples/sim_7b.yaml).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. data.prompts_per_step=512.")] = None,
    devices: Annotated[int | None, typer.Option(help="Device budget, whole nodes (default: the config's).")] = None,
    max_staleness: Annotated[int, typer.Option(help="Largest staleness bound k allowed.")] = 4,
    node_size: Annotated[int, typer.Option(help="Devices per node (the trainer takes whole nodes).")] = 8,
    replicas_per_node: Annotated[str, typer.Option(help="Rollout replicas per node to consider (comma-separated).")] = "1,2,4,8",
    steps: Annotated[int, typer.Option(help="Measured steps per simulation, after a warm-up of k + 1.")] = 3,
    shortlist: Annotated[int, typer.Option(help="Placements screened first (best by the closed-form estimate).")] = 8,
    finalists: Annotated[int, typer.Option(help="Best screened placements measured over every --steps.")] = 3,
    full: Annotated[bool, typer.Option("--full", help="Simulate every placement (slow; the reference).")] = False,
    workers: Annotated[int | None, typer.Option(help="Simulations at once (default: every core).")] = None,
    cutoff: Annotated[bool, typer.Option(help="Stop a simulation once it cannot rank among the best (its row "
                                              "then holds an upper bound, shown '< x'); the pick is the same.")] = True,
    out: Annotated[Path, typer.Option(help="Directory for plan.json, pareto.png, overlay.yaml, chosen.yaml.")] = Path("plan"),
    start_floor: Annotated[bool, typer.Option(help="Also measure the finalists with k >= 1 with "
                                                   "async.start_on_step_weights (a prompt starts only on its step's "
                                                   "weights), and pick it where it is faster.")] = True,
    progress: Annotated[bool, typer.Option(help="Progress bar on a terminal.")] = True,
) -> None:
    """Pick the staleness bound and the rollout/train placement for a simulated config: a ranked table, a Pareto
    plot of throughput against staleness, and the pick as a config overlay."""
    import sys

    from rich.console import Console

    try:
        rpn = [int(x) for x in replicas_per_node.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--replicas-per-node {replicas_per_node!r}: give integers, e.g. 1,2,4,8") from None
    result = run_plan(config, overrides or [], devices=devices, node_size=node_size, max_k=max_staleness,
                      replicas_per_node=rpn, measured_steps=steps, shortlist=shortlist, finalists=finalists,
                      full=full, workers=workers, cutoff=cutoff, start_floor=start_floor,
                      progress=progress and sys.stderr.isatty())
    console = Console(width=None if sys.stdout.isatty() else 200)
    print_table(result, console)
    files = write_outputs(result, out)
    c = Candidate(**result.chosen["candidate"])
    console.print(f"pick: {c.label}  ({result.chosen['samples_per_s']:.2f} samples/s, "
                  f"{result.chosen['efficiency_vs_ideal']:.2f} of the ideal); {result.simulated} simulations in "
                  f"{result.wall_s:.0f} s")
    console.print(f"run it: asyncflow run {config} {' '.join(c.overrides())}")
    Console(stderr=True).print(f"wrote {', '.join(str(p) for p in files.values())}")
