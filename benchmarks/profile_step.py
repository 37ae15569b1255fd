"""Profile one training step of the real runtime at several model sizes: where a step's wall time goes.

Usage: python benchmarks/profile_step.py [--sizes 0.1M,10M,100M,0.5B] [--steps N] [--warmup W] [--cooldown C]
                                         [--checkpoint-every K] [--logprob-stages] [--json] [--png PATH]
                                         [--out runs/profile_step] [override ...]
       python benchmarks/profile_step.py --rank-step [--rank-settings NAMES] [--repeats R] [--json]
       python benchmarks/profile_step.py --engine-step [--engine-settings NAMES] [--batches B] [--repeats R] [--json]

Each size is a real run of ``examples/arithmetic_grpo.yaml`` (``one_step``,
the ``local`` launcher, the ``torch`` rollout engine, the ``fsdp`` trainer at
world size 1, the in-process store and weight transport) with only the
model swapped for random weights of that shape (``SIZES``), in a process of
its own (so each size's peak RSS is its own). ``W`` warm-up steps run first,
then the ``N`` measured steps, then ``C`` cool-down steps (``trainer.total_steps
= W + N + C``): a run's last step is not a steady one (nothing is left to
generate beside it), nor is its first (nothing was generated before it).

A step is the window between the ends of two consecutive steps (the
``time_s`` and ``step_seconds`` of ``metrics.jsonl``). Inside it the split
comes from the runtime's own ``Timeline`` spans (``generate``, ``score``,
``logprobs``, ``advantages``, ``train_step``, ``send_weights``,
``update_weights``, ``checkpoint``) refined by probes where the runtime has no
span of its own:

- in the rank process (a rank spawner that wraps the rank's entry point):
  each command's time in the rank, and inside ``train`` the time in
  ``Tensor.backward`` and in gradient clipping plus ``optimizer.step``;
  ``train_forward`` is the rest of the rank's ``train`` command (forward,
  loss, bookkeeping) and ``train_ipc`` is the rest of the driver's
  ``train_step`` span (input checks, planning, pickling, the pipe to the
  rank and back);
- in the driver: the time inside the trainer's ``export_weights`` iterator
  (``weight_export``: the rank's gather and pack, the shared-memory hand-off),
  the rollout engine's install of a received version (``weight_load``; the
  rest of ``update_weights`` and of ``send_weights`` is ``weight_transfer``:
  staging and checksum verification), and the time the in-process store's
  lock is held (``store``: every store call's synchronous work).

Two views per step. ``phases_s`` is exclusive and sums to the step's wall
time: each instant goes to one phase, the trainer's critical path first
(train_backward/optimizer > train_forward > train_ipc > weight_export >
weight_transfer (send side) > checkpoint), then store > weight_load >
weight_transfer (receive side) > old_ref_logprobs > reward > advantage >
generate > other; ``idle`` is time with nothing busy. ``busy_s`` is each
phase's own busy time (union of its intervals), which overlaps across
phases (generation runs beside training in ``one_step``); a phase measured
inside another (the rank's command inside ``train_step``) is not counted again
in the outer one.

Peak RSS per process is ``VmHWM`` from ``/proc``: the driver's own, and
every descendant's (rank processes, the forkserver), found by walking
``/proc/*/stat`` parent ids while the run is on. ``cpu_s_per_step`` is
each of those processes' CPU seconds (user + system, ``/proc/PID/stat``,
read every 0.2 s and interpolated) over the measured steps, per step: what
each side costs, which on a shared machine is steadier than its wall time.

``--rank-step`` measures one thing only, the least noisy on a shared
machine: the **CPU time** of one world-1 ``fsdp`` rank's train step, run in
this process (no driver, no generation beside it), on the example's model
and a batch of its shape (32 prompts of 4 tokens x 8 responses of 2-3
tokens, one micro-batch, one torch thread), per :data:`RANK_SETTINGS`
(``always``: FSDP2 at world 1, as before ``shard: auto`` existed;
``auto``: the plain model on the padded rectangle; ``auto+shared``: the
default, each prompt once (``share_prompts``); ``floor``: no rank, a plain
Hugging Face forward + backward + AdamW step of the same model on the
same rectangle). Each repetition runs every setting in turn and takes the
median of 10 steps after 2 warm-up steps. ``--rank-settings auto+shared``
(comma-separated names; default all) measures only the settings named.

``--engine-step`` measures the ``torch`` rollout engine alone, in this
process: the **CPU time** (every thread of the process: the event loop's
side, the worker thread's decoding steps, torch's intra-op threads; so run
it with the run's ``OMP_NUM_THREADS``) of one batch of the example's shape
(``prompts_per_step`` prompts ``a+b=`` of the example's alphabet, ``n``
samples each, ``max_new_tokens``, stop at its end token, the example's
``max_batch``), from the ``generate`` call to its last result, per
:data:`ENGINE_SETTINGS` (``shared``: the default, rows with identical
contexts decoded once; ``unshared``: ``share_contexts`` off, one row per
sequence). The model is the example's at its initial weights
(``init_seed`` 0): a trained policy samples fewer distinct tokens, so its
rows share more. Each repetition runs every setting in turn on a fresh
engine: 3 warm-up batches, then the median over ``--batches`` batches; also
reported per batch: the forward passes and the rows they ran (a prefill's
rows are its distinct prompts).

``--logprob-stages`` adds ``algorithm.options.correction=decoupled`` and
``kl_coef=0.001`` so the ``old`` and ``ref`` log-prob stages run (the
example as shipped needs neither: ``old_ref_logprobs`` is then 0).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"

#: model shapes (Hugging Face configs); None: the example's own model
SIZES: dict[str, dict[str, Any] | None] = {
    "0.1M": None,
    # Qwen2 layouts (2 KV heads, SwiGLU, tied embeddings) over the task's 14-token vocabulary
    "10M": {"model_type": "qwen2", "vocab_size": 14, "hidden_size": 256, "intermediate_size": 1376,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32, "tie_word_embeddings": True},
    "100M": {"model_type": "qwen2", "vocab_size": 14, "hidden_size": 768, "intermediate_size": 3072,
             "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
             "max_position_embeddings": 32, "tie_word_embeddings": True},
    # the Qwen2.5-0.5B shape, with its full vocabulary
    "0.5B": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
             "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "max_position_embeddings": 32, "tie_word_embeddings": True},
}

#: exclusive phases, in display order
PHASES = ("generate", "reward", "old_ref_logprobs", "advantage", "train_forward", "train_backward",
          "train_optimizer", "train_ipc", "weight_export", "weight_transfer", "weight_load", "checkpoint",
          "store", "other", "idle")

#: priority of each interval kind in the exclusive split (higher wins); kinds map to phases in ``_KIND_PHASE``
_PRIORITY = {
    "train_backward": 100, "train_optimizer": 100, "train_forward": 90, "train_ipc": 80, "weight_export": 70,
    "weight_transfer_send": 60, "checkpoint": 55, "store": 50, "weight_load": 45, "weight_transfer_recv": 40,
    "old_ref_logprobs": 30, "reward": 29, "advantage": 28, "generate": 20, "other": 10,
}
_KIND_PHASE = {k: k for k in _PRIORITY} | {"weight_transfer_send": "weight_transfer",
                                           "weight_transfer_recv": "weight_transfer"}
#: timeline span name -> interval kind (spans not listed and not waiting are "other")
_SPAN_KIND = {"generate": "generate", "score": "reward", "logprobs": "old_ref_logprobs",
              "advantages": "advantage", "train_step": "train_ipc", "send_weights": "weight_transfer_send",
              "update_weights": "weight_transfer_recv", "checkpoint": "checkpoint"}
_WAITING = frozenset({"admission_wait", "wait_batch"})
#: phases measured inside another's intervals: its busy time excludes them
_NESTED = {"train_forward": ("train_backward", "train_optimizer"),
           "train_ipc": ("train_forward", "train_backward", "train_optimizer"),
           "weight_transfer": ("weight_export", "weight_load")}


# ------------------------------------------------------------------------------------------ /proc

def _status_kb(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _children_of(root: int) -> set[int]:
    """Every live descendant of ``root`` (parent ids from ``/proc/*/stat``)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
            parent[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out: set[int] = set()
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                out.add(child)
                frontier.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _cpu_s(pid: int | str) -> float | None:
    """User + system CPU seconds of a process so far (``/proc/PID/stat`` fields 14 and 15)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """CPU seconds a process used between two instants, interpolated between its (time, CPU seconds) samples."""
    if len(samples) < 2 or start < samples[0][0] or end > samples[-1][0]:
        return None

    def at(t: float) -> float:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return samples[-1][1]

    return at(end) - at(start)


class _RssSampler:
    """Polls the peak RSS (VmHWM) of this process's descendants (a process's last reading is its peak), and the CPU
    seconds of this process and each descendant over time (``time.monotonic``, the timeline's clock)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.peak_kb: dict[int, int] = {}
        self.label: dict[int, str] = {}
        self.cpu: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        for pid in (os.getpid(), *_children_of(os.getpid())):
            cpu = _cpu_s(pid)
            if cpu is not None:
                self.cpu[pid].append((now, cpu))
            if pid == os.getpid():
                continue
            kb = _status_kb(pid, "VmHWM")
            if kb is None:
                continue
            self.peak_kb[pid] = max(kb, self.peak_kb.get(pid, 0))
            if pid not in self.label:
                cmd = _cmdline(pid)
                self.label[pid] = ("forkserver" if "forkserver" in cmd else
                                   "resource_tracker" if "resource_tracker" in cmd else "child")


# ------------------------------------------------------------------------------------------ rank probe

class _RankRecorder:
    """Intervals of one rank process (time.monotonic, the driver's event-loop clock), one JSON line per command."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.parts: list[tuple[str, float, float]] = []
        self.recv_bytes = 0

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.parts.append((name, start, time.monotonic()))

    def command(self, op: str, start: float, end: float) -> None:
        record = {"pid": os.getpid(), "rank": self.rank, "op": op, "start": start, "end": end,
                  "recv_bytes": self.recv_bytes, "parts": self.parts,
                  "vmhwm_kb": _status_kb("self", "VmHWM")}
        self.parts, self.recv_bytes = [], 0
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class _CountingConn:
    """The rank's pipe, counting the bytes of each command it receives."""

    def __init__(self, conn: Any, rec: _RankRecorder) -> None:
        self._conn = conn
        self._rec = rec

    def recv_bytes(self, *args: Any) -> bytes:
        data = self._conn.recv_bytes(*args)
        self._rec.recv_bytes += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _install_rank_probes(target: Any, rec: _RankRecorder) -> None:
    import torch

    from asyncflow_core.launchers.rank_worker import RankWorkerBase

    module = sys.modules[target.__module__]
    workers = [v for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, RankWorkerBase) and v.__module__ == module.__name__]
    for cls in workers:  # the engine's own worker classes (each op wrapped once, inherited ones included)
        for name in [n for n in dir(cls) if n.startswith("op_")]:
            fn = getattr(cls, name)

            def timed(self: Any, payload: Any, _fn: Any = fn, _op: str = name[3:]) -> Any:
                start = time.monotonic()
                try:
                    return _fn(self, payload)
                finally:
                    rec.command(_op, start, time.monotonic())

            setattr(cls, name, functools.wraps(fn)(timed))

    backward = torch.Tensor.backward

    def timed_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with rec.span("train_backward"):
            return backward(self, *args, **kwargs)

    torch.Tensor.backward = timed_backward  # type: ignore[method-assign]
    clip = torch.nn.utils.clip_grad_norm_

    def timed_clip(*args: Any, **kwargs: Any) -> Any:
        with rec.span("train_optimizer"):
            return clip(*args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = timed_clip
    started: list[float] = []
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *_: started.append(time.monotonic()))
    register_optimizer_step_post_hook(lambda *_: rec.parts.append(("train_optimizer", started.pop(),
                                                                   time.monotonic())))


def probe_rank_main(rank: int, world_size: int, conn: Any, target: Any, out_dir: str, *args: Any) -> None:
    """A rank's entry point with the probes installed; then the engine's own ``target``."""
    rec = _RankRecorder(Path(out_dir) / f"rank{rank}-{os.getpid()}.jsonl", rank)
    _install_rank_probes(target, rec)
    target(rank, world_size, _CountingConn(conn, rec), *args)


def _probe_spawner(out_dir: Path) -> Any:
    from asyncflow_core.launchers.ranks import RankGroup, RankSpawner

    import profile_step  # this module by its importable name, so rank processes can unpickle the entry point

    class ProbeSpawner(RankSpawner):
        def start(self, world_size: int, target: Any, args: tuple[Any, ...], *, start_method: str,
                  preload: Any = (), name: str = "asyncflow-rank") -> Any:
            return RankGroup(world_size, profile_step.probe_rank_main, (target, str(out_dir), *args),
                             start_method=start_method, preload=preload, name=name)

    return ProbeSpawner()


# ------------------------------------------------------------------------------------------ driver probes

@contextlib.contextmanager
def _driver_probes(intervals: list[tuple[str, float, float]], notes: list[str]) -> Iterator[None]:
    """Time the export iterator, the rollout engine's install, and the in-process store's lock (restored after)."""
    undo: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    from asyncflow_core.launchers import rank_driver
    from asyncflow_core.store import inprocess

    export = rank_driver.RankEngineDriver.export_weights

    async def timed_export(self: Any, *args: Any, **kwargs: Any) -> Any:
        it = export(self, *args, **kwargs).__aiter__()
        while True:
            start = time.monotonic()
            try:
                bucket = await it.__anext__()
            except StopAsyncIteration:
                intervals.append(("weight_export", start, time.monotonic()))
                return
            intervals.append(("weight_export", start, time.monotonic()))
            yield bucket

    patch(rank_driver.RankEngineDriver, "export_weights", functools.wraps(export)(timed_export))

    try:
        from asyncflow_plugins.hf.rollout import TorchRolloutEngine
    except ImportError:  # pragma: no cover - the hf plugin ships with the core
        TorchRolloutEngine = None  # noqa: N806
    install = getattr(TorchRolloutEngine, "_install", None)
    if install is not None:
        async def timed_install(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return await install(self, *args, **kwargs)
            finally:
                intervals.append(("weight_load", start, time.monotonic()))

        patch(TorchRolloutEngine, "_install", functools.wraps(install)(timed_install))
    else:
        notes.append("TorchRolloutEngine._install not found: weight_load is counted in weight_transfer")

    class TimedLock:
        def __init__(self) -> None:
            self._lock = threading.Lock()
            self._since = 0.0

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            ok = self._lock.acquire(blocking, timeout)
            if ok:
                self._since = time.monotonic()
            return ok

        def release(self) -> None:
            since = self._since
            self._lock.release()
            intervals.append(("store", since, time.monotonic()))

        def locked(self) -> bool:
            return self._lock.locked()

        def __enter__(self) -> bool:
            return self.acquire()

        def __exit__(self, *exc: Any) -> None:
            self.release()

    init = inprocess.InProcessStore.__init__

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if isinstance(getattr(self, "_lock", None), type(threading.Lock())):
            self._lock = TimedLock()
        else:
            notes.append("InProcessStore._lock is not a plain lock: store time is not measured")

    patch(inprocess.InProcessStore, "__init__", functools.wraps(init)(timed_init))
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


# ------------------------------------------------------------------------------------------ the split

def _union(ivs: list[tuple[float, float]]) -> float:
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(ivs):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0.0)


def split_window(intervals: list[tuple[str, float, float]], start: float, end: float) -> tuple[dict, dict]:
    """(exclusive seconds per phase, summing to ``end - start``; busy seconds per phase) inside the window."""
    clipped = [(kind, max(a, start), min(b, end)) for kind, a, b in intervals if min(b, end) > max(a, start)]
    busy_ivs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    events: list[tuple[float, int, str]] = []
    for kind, a, b in clipped:
        busy_ivs[_KIND_PHASE[kind]].append((a, b))
        events.append((a, 1, kind))
        events.append((b, -1, kind))
    events.sort(key=lambda e: e[0])
    exclusive = dict.fromkeys(PHASES, 0.0)
    active: dict[str, int] = defaultdict(int)
    prev = start
    i = 0
    while i < len(events):
        t = events[i][0]
        if t > prev:
            live = [k for k, c in active.items() if c > 0]
            phase = _KIND_PHASE[max(live, key=_PRIORITY.__getitem__)] if live else "idle"
            exclusive[phase] += t - prev
            prev = t
        while i < len(events) and events[i][0] == t:
            active[events[i][2]] += events[i][1]
            i += 1
    exclusive["idle"] += max(0.0, end - prev)
    busy = dict.fromkeys(PHASES[:-1], 0.0)
    for phase, ivs in busy_ivs.items():
        inner = [iv for child in _NESTED.get(phase, ()) for iv in busy_ivs.get(child, [])]
        # own time only: |own ∪ nested| - |nested| (train_ipc without the rank's command inside it, ...)
        busy[phase] = max(0.0, _union(ivs + inner) - _union(inner)) if inner else _union(ivs)
    return exclusive, busy


def _intervals(timeline: Any, driver: list[tuple[str, float, float]], ranks: list[dict[str, Any]]) -> list:
    out: list[tuple[str, float, float]] = []
    for s in timeline.spans:
        if s.name in _WAITING:
            continue
        out.append((_SPAN_KIND.get(s.name, "other"), s.start, s.end))
    out.extend(driver)
    for rec in ranks:
        if rec["op"] == "train":
            out.append(("train_forward", rec["start"], rec["end"]))
            out.extend((name, a, b) for name, a, b in rec["parts"])
    return out


# ------------------------------------------------------------------------------------------ one size

def _param_count(hf: dict[str, Any]) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # tied tensors once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _config_data(size: str, total_steps: int, checkpoint_every: int, logprob_stages: bool) -> dict:
    from asyncflow_core.config.loader import read_yaml

    raw = read_yaml(EXAMPLE)
    shape = SIZES[size]
    if shape is not None:
        raw["model"]["hf_config"] = dict(shape)
    raw.setdefault("async", {})["mode"] = "one_step"
    raw["rollout"]["name"] = "torch"
    raw["trainer"]["name"] = "fsdp"
    raw["trainer"].setdefault("options", {})["world_size"] = 1
    raw["trainer"]["total_steps"] = total_steps
    raw["trainer"]["checkpoint_every"] = checkpoint_every
    raw["trainer"]["export_final"] = False
    raw.setdefault("launcher", {})["name"] = "local"
    if logprob_stages:
        opts = raw.setdefault("algorithm", {}).setdefault("options", {})
        opts["correction"] = "decoupled"
        opts["kl_coef"] = 0.001
    return raw


def profile_size(size: str, *, steps: int, warmup: int, cooldown: int, checkpoint_every: int, logprob_stages: bool,
                 out: Path, overrides: list[str]) -> dict[str, Any]:
    """One run of ``size`` in this process; the profile of its measured steps."""
    from asyncflow_core.config.loader import apply_overrides, load_config, resolve
    from asyncflow_core.flow.launcher import launch
    from asyncflow_core.flow.telemetry import load_metrics, observe_timelines
    from asyncflow_core.launchers.ranks import use_rank_spawner

    run_dir = out / size
    probe_dir = run_dir / "probe"
    probe_dir.mkdir(parents=True, exist_ok=True)
    for old in probe_dir.glob("*.jsonl"):
        old.unlink()
    raw = apply_overrides(_config_data(size, warmup + steps + cooldown, checkpoint_every, logprob_stages), overrides)
    cfg = load_config(data=raw)
    hf = dict(cfg.model.hf_config or {})
    driver: list[tuple[str, float, float]] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    with _RssSampler() as rss, observe_timelines() as timelines, _driver_probes(driver, notes), \
            use_rank_spawner(_probe_spawner(probe_dir)):
        summary = launch(resolve(cfg), run_dir=run_dir)
    wall = time.perf_counter() - t0
    timeline = timelines[0]
    ranks = [json.loads(line) for f in sorted(probe_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    intervals = _intervals(timeline, driver, ranks)
    records = load_metrics(run_dir / "metrics.jsonl")
    measured = records[warmup:warmup + steps]
    if len(measured) < steps:
        raise RuntimeError(f"the run logged {len(records)} steps, fewer than warm-up + measured ({warmup} + {steps})")
    per_step = []
    for r in measured:
        end = timeline.t0 + r["time_s"]
        start = end - r["step_seconds"]
        exclusive, busy = split_window(intervals, start, end)
        per_step.append({"step": r["step"], "step_s": r["step_seconds"], "samples": r["samples"],
                         "phases_s": exclusive, "busy_s": busy})
    n = len(per_step)
    step_s = sum(s["step_s"] for s in per_step) / n
    peak = {"driver": (_status_kb("self", "VmHWM") or 0) / 1024}
    rank_pids = {rec["pid"]: rec["rank"] for rec in ranks}
    for rec in ranks:
        rss.peak_kb[rec["pid"]] = max(rss.peak_kb.get(rec["pid"], 0), rec.get("vmhwm_kb") or 0)
    labels: dict[str, int] = defaultdict(int)
    keys = {os.getpid(): "driver"}
    for pid, kb in sorted(rss.peak_kb.items()):
        label = f"rank{rank_pids[pid]}" if pid in rank_pids else rss.label.get(pid, "child")
        labels[label] += 1
        key = label if labels[label] == 1 else f"{label}#{labels[label]}"
        peak[key] = kb / 1024
        keys[pid] = key
    # CPU seconds per measured step of each process (the window from the first measured step's start to the last's
    # end, interpolated between the sampler's readings): what each process costs, whatever else shares the cores
    window_end = timeline.t0 + measured[-1]["time_s"]
    window_start = timeline.t0 + measured[0]["time_s"] - measured[0]["step_seconds"]
    cpu_per_step = {}
    for pid, key in keys.items():
        used = _cpu_between(rss.cpu.get(pid, []), window_start, window_end)
        if used is not None and used > 0:
            cpu_per_step[key] = used / n
    rank_ops: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "seconds": 0.0, "recv_mb": 0.0})
    for rec in ranks:
        o = rank_ops[rec["op"]]
        o["calls"] += 1
        o["seconds"] += rec["end"] - rec["start"]
        o["recv_mb"] += rec["recv_bytes"] / 2**20
    return {
        "size": size,
        "params": _param_count(hf),
        "hf_config": hf,
        "steps_measured": n,
        "warmup_steps": warmup,
        "cooldown_steps": cooldown,
        "checkpoint_every": checkpoint_every,
        "logprob_stages": logprob_stages,
        "step_s": step_s,
        "samples_per_s": sum(s["samples"] for s in per_step) / sum(s["step_s"] for s in per_step),
        "phases_s": {p: sum(s["phases_s"][p] for s in per_step) / n for p in PHASES},
        "busy_s": {p: sum(s["busy_s"][p] for s in per_step) / n for p in PHASES[:-1]},
        "steps": per_step,
        "peak_rss_mb": peak,
        "cpu_s_per_step": cpu_per_step,
        "rank_ops": dict(rank_ops),
        "utilisation": summary.get("utilisation"),
        "wall_s": wall,
        "notes": notes,
        "run_dir": str(run_dir),
    }


# ------------------------------------------------------------------------------------------ output

def stacked_png(results: list[dict[str, Any]], path: Path) -> Path:
    """One stacked bar per size: each phase's share of the step (exclusive split), seconds per step on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(8, 5))
    x = range(len(results))
    bottom = [0.0] * len(results)
    for i, phase in enumerate(PHASES):
        share = [r["phases_s"][phase] / r["step_s"] * 100 if r["step_s"] > 0 else 0.0 for r in results]
        ax.bar(x, share, bottom=bottom, color="#dddddd" if phase == "idle" else colours[i % len(colours)],
               label=phase, width=0.6)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    for i, r in enumerate(results):
        ax.text(i, 101, f'{r["step_s"]:.3g} s/step', ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f'{r["size"]}\n({r["params"] / 1e6:.3g}M params)' for r in results])
    ax.set_ylabel("% of a step (exclusive split)")
    ax.set_ylim(0, 110)
    ax.set_title("one one_step training step: where the wall time goes")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _table(results: list[dict[str, Any]]) -> str:
    head = ["size", "params", "s/step", "samples/s", *PHASES, "CPU s/step", "peak RSS MB"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items())
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in r.get("cpu_s_per_step", {}).items())
        lines.append(" | ".join([r["size"], f'{r["params"] / 1e6:.3g}M', f'{r["step_s"]:.3f}',
                                 f'{r["samples_per_s"]:.1f}', *(f'{r["phases_s"][p]:.3f}' for p in PHASES), cpu,
                                 rss]))
    return "\n".join(lines)


#: --rank-step settings: the rank's options on top of the example's (None: the floor, no rank at all)
RANK_SETTINGS: dict[str, dict[str, Any] | None] = {
    "always": {"shard": "always", "share_prompts": False},  # FSDP2 at world 1 (before shard: auto)
    "auto": {"shard": "auto", "share_prompts": False},  # the plain model, one padded rectangle (before sharing)
    "auto+shared": {"shard": "auto", "share_prompts": True},  # the default: each prompt once per micro-batch
    "floor": None,  # a plain HF forward + backward + AdamW step on the rectangle, in this process
}


def _rank_batch(example: dict[str, Any]) -> Any:
    """One step's rows of the example's shape: prompts_per_step prompts of 4 tokens, n samples each of 2-3 tokens."""
    import torch

    from asyncflow_core import columns as C
    from asyncflow_core.types import Batch, RaggedTensor

    gen = torch.Generator().manual_seed(0)
    n = example["rollout"]["n"]
    rows = example["data"]["prompts_per_step"] * n
    vocab = example["model"]["hf_config"]["vocab_size"]
    distinct = [torch.randint(0, vocab, (4,), generator=gen) for _ in range(rows // n)]
    prompts = RaggedTensor.from_sequences([distinct[i // n] for i in range(rows)])
    responses = RaggedTensor.from_sequences(
        [torch.randint(0, vocab, (int(torch.randint(2, 4, (1,), generator=gen)),), generator=gen) for _ in range(rows)])
    advantages = torch.repeat_interleave(torch.randn(rows, generator=gen), responses.lengths)
    return Batch({C.PROMPT_IDS: prompts, C.RESPONSE_IDS: responses,
                  C.ADVANTAGES: RaggedTensor(advantages, responses.offsets),
                  C.BEHAVIOR_LOGPROBS: RaggedTensor(-torch.rand(responses.numel_packed, generator=gen),
                                                    responses.offsets)})


def _floor_step(example: dict[str, Any], batch: Any) -> Any:
    """The least a train step of this batch can cost: the example's model, a plain HF forward over the padded
    rectangle, log-softmax at the response tokens, an advantage-weighted token mean, backward, clipping, AdamW."""
    import torch

    from asyncflow_core import columns as C
    from asyncflow_core.config.models import ModelConfig
    from asyncflow_fsdp.forward import layout
    from asyncflow_plugins.hf.model import build_causal_lm

    model = build_causal_lm(ModelConfig.model_validate(example["model"]), seed=0).float()
    opts = example["trainer"]["options"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    lay = layout(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS])
    adv = batch[C.ADVANTAGES].values

    def step() -> None:
        logits = model(input_ids=lay.input_ids, use_cache=False).logits
        logp = torch.log_softmax(logits[lay.row, lay.position].float(), -1).gather(1, lay.targets[:, None])
        (-(logp.squeeze(1) * adv).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def rank_step(repeats: int, settings: list[str] | None = None) -> dict[str, Any]:
    """CPU seconds of a world-1 rank's train step per setting of :data:`RANK_SETTINGS` (see the module docstring),
    only those named in ``settings`` (default: all)."""
    import torch
    import yaml

    from asyncflow_fsdp.testing import local_rank, train_payload
    from asyncflow_plugins.algorithms import GRPO, GRPOConfig

    torch.set_num_threads(1)
    example = yaml.safe_load(EXAMPLE.read_text())
    batch = _rank_batch(example)
    algorithm = GRPO(GRPOConfig(**example["algorithm"]["options"]))
    payload = train_payload(batch, algorithm)
    options = {"model": example["model"], **example["trainer"]["options"], "device": "cpu", "cpu_threads_per_rank": 1}
    medians: dict[str, list[float]] = {k: [] for k in (settings or RANK_SETTINGS)}

    def median_cpu(step: Any) -> float:
        for _ in range(2):
            step()
        cpu = []
        for _ in range(10):
            t = time.process_time()
            step()
            cpu.append(time.process_time() - t)
        return sorted(cpu)[len(cpu) // 2]

    for _ in range(repeats):
        for name in medians:
            setting = RANK_SETTINGS[name]
            if setting is None:
                medians[name].append(median_cpu(_floor_step(example, batch)))
                continue
            with local_rank({**options, **setting}) as worker:
                medians[name].append(median_cpu(lambda w=worker: w.op_train(payload)))
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    return {"rank_step_cpu_s": {k: {"median": sorted(v)[len(v) // 2], "min": min(v), "repeats": v}
                                for k, v in medians.items()}, "rows": batch.num_rows,
            "tokens": int(prompts.numel_packed + responses.numel_packed)}


#: --engine-step settings: the torch engine's options on top of the example's
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "shared": {},  # the default: sequences with identical contexts share a row of the batch
    "unshared": {"share_contexts": False},  # one row per sequence (after a shared prefill)
}


def engine_step(batches: int, repeats: int, settings: list[str] | None = None) -> dict[str, Any]:
    """CPU seconds per batch of the example's shape through the torch rollout engine (see the module docstring)."""
    import asyncio

    import torch
    import yaml

    from asyncflow_core.config.models import ModelConfig
    from asyncflow_core.types import GenerationRequest, SamplingParams
    from asyncflow_plugins.hf.rollout import TorchRolloutConfig, TorchRolloutEngine

    example = yaml.safe_load(EXAMPLE.read_text())
    model = ModelConfig.model_validate(example["model"])
    alphabet, n = example["model"]["alphabet"], example["rollout"]["n"]
    sampling = SamplingParams(max_new_tokens=example["rollout"]["max_new_tokens"],
                              stop_token_ids=(alphabet.index(example["model"]["eos"]),))
    gen = torch.Generator().manual_seed(0)

    def batch(tag: str) -> list[GenerationRequest]:
        out = []
        for p in range(example["data"]["prompts_per_step"]):
            a, b = torch.randint(0, 10, (2,), generator=gen).tolist()
            prompt = tuple(alphabet.index(c) for c in f"{a}+{b}=")
            out += [GenerationRequest(f"{tag}-{p}-{j}", prompt, sampling) for j in range(n)]
        return out

    async def measure(options: dict[str, Any]) -> tuple[float, float, float, float]:
        engine = TorchRolloutEngine(TorchRolloutConfig(
            model=model, device="cpu", init_seed=example.get("seed", 0), **{**example["rollout"]["options"], **options}))
        await engine.start()
        forward, counts = engine._forward, [0, 0]

        def counted(ids: Any, *args: Any) -> Any:
            counts[0] += 1
            counts[1] += ids.shape[0]
            return forward(ids, *args)

        engine._forward = counted
        try:
            for i in range(3):
                [r async for r in engine.generate(batch(f"w{i}"))]
            counts[:] = [0, 0]
            cpu, wall = [], []
            for i in range(batches):
                requests = batch(f"b{i}")
                t, w = time.process_time(), time.perf_counter()
                [r async for r in engine.generate(requests)]
                cpu.append(time.process_time() - t)
                wall.append(time.perf_counter() - w)
        finally:
            await engine.shutdown()
        return sorted(cpu)[len(cpu) // 2], sorted(wall)[len(wall) // 2], counts[0] / batches, counts[1] / batches

    medians: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in (settings or ENGINE_SETTINGS)}
    for _ in range(repeats):
        for name in medians:
            medians[name].append(asyncio.run(measure(ENGINE_SETTINGS[name])))
    return {"engine_batch_cpu_s": {k: {"median": sorted(c for c, *_ in v)[len(v) // 2], "min": min(c for c, *_ in v),
                                       "repeats": [c for c, *_ in v],
                                       "wall_s_median": sorted(w for _, w, *_ in v)[len(v) // 2],
                                       "forwards_per_batch": v[-1][2], "forward_rows_per_batch": v[-1][3]}
                                   for k, v in medians.items()},
            "requests_per_batch": example["data"]["prompts_per_step"] * n, "batches": batches,
            "torch_threads": torch.get_num_threads()}


def _names(p: argparse.ArgumentParser, option: str, value: str, known: dict[str, Any]) -> list[str]:
    """The comma-separated names in ``value``, each once, in order; a usage error names one not in ``known``."""
    names = [x for x in value.split(",") if x]
    if not names or any(x not in known for x in names):
        p.error(f"{option} {value!r}: choose from {','.join(known)} (comma-separated)")
    return list(dict.fromkeys(names))


def _report(as_json: bool, res: dict[str, Any], header: list[str], rows: list[list[str]]) -> int:
    """Print ``res`` as one JSON object, or the table of ``rows`` under ``header``; exit status 0."""
    if as_json:
        print(json.dumps(res))
        return 0
    for line in (header, ["---"] * len(header), *rows):
        print(" | ".join(line))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.1M,10M,100M,0.5B", help=f"comma-separated, from {','.join(SIZES)}")
    p.add_argument("--steps", type=int, default=3, help="measured steps per size (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="steps run before the measured ones")
    p.add_argument("--cooldown", type=int, default=1, help="steps run after the measured ones (not measured)")
    p.add_argument("--checkpoint-every", type=int, default=1, help="trainer.checkpoint_every (0: no checkpoints)")
    p.add_argument("--logprob-stages", action="store_true", help="also run the old and ref log-prob stages")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "profile_step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--png", type=Path, default=None, help="write the stacked-bar chart of the split here")
    p.add_argument("--rank-step", action="store_true",
                   help="only the CPU time of a world-1 rank's train step per setting, and the floor (docstring)")
    p.add_argument("--repeats", type=int, default=4, help="--rank-step: interleaved repetitions per setting")
    p.add_argument("--rank-settings", default=",".join(RANK_SETTINGS),
                   help=f"--rank-step: comma-separated settings to measure, from {','.join(RANK_SETTINGS)}")
    p.add_argument("--engine-step", action="store_true",
                   help="only the CPU time of the torch rollout engine per batch of the example's shape (docstring)")
    p.add_argument("--engine-settings", default=",".join(ENGINE_SETTINGS),
                   help=f"--engine-step: comma-separated settings to measure, from {','.join(ENGINE_SETTINGS)}")
    p.add_argument("--batches", type=int, default=30, help="--engine-step: measured batches per repetition")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: profile one size in this process
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every size")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.cooldown < 0 or a.checkpoint_every < 0:
        p.error("--steps must be >= 1; --warmup, --cooldown and --checkpoint-every >= 0")
    if a.engine_step:
        if a.repeats < 1 or a.batches < 1:
            p.error("--repeats and --batches must be >= 1")
        res = engine_step(a.batches, a.repeats, _names(p, "--engine-settings", a.engine_settings, ENGINE_SETTINGS))
        return _report(a.json, res, ["setting", "CPU ms per batch (median of repeats)", "min", "wall ms", "forwards",
                                     "forward rows"],
                       [[name, f"{r['median'] * 1e3:.2f}", f"{r['min'] * 1e3:.2f}", f"{r['wall_s_median'] * 1e3:.2f}",
                         f"{r['forwards_per_batch']:.1f}", f"{r['forward_rows_per_batch']:.0f}"]
                        for name, r in res["engine_batch_cpu_s"].items()])
    if a.rank_step:
        if a.repeats < 1:
            p.error("--repeats must be >= 1")
        res = rank_step(a.repeats, _names(p, "--rank-settings", a.rank_settings, RANK_SETTINGS))
        return _report(a.json, res, ["setting", "CPU ms per train step (median of repeats)", "min"],
                       [[name, f"{r['median'] * 1e3:.1f}", f"{r['min'] * 1e3:.1f}"]
                        for name, r in res["rank_step_cpu_s"].items()])
    if a.one is not None:
        res = profile_size(a.one, steps=a.steps, warmup=a.warmup, cooldown=a.cooldown,
                           checkpoint_every=a.checkpoint_every,
                           logprob_stages=a.logprob_stages, out=a.out, overrides=a.overrides)
        print("PROFILE_RESULT " + json.dumps(res))
        return 0
    sizes = [s for s in a.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        p.error(f"--sizes {a.sizes!r}: choose from {','.join(SIZES)} (comma-separated)")
    results = []
    for size in sizes:  # one process per size: its peak RSS and its rank group are its own
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", size, "--steps", str(a.steps),
               "--warmup", str(a.warmup), "--cooldown", str(a.cooldown), "--checkpoint-every", str(a.checkpoint_every), "--out", str(a.out),
               *(["--logprob-stages"] if a.logprob_stages else []), *a.overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("PROFILE_RESULT ")), None)
        if proc.returncode != 0 or line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            print(f"profile of size {size} failed (exit {proc.returncode}): {tail[0]}", file=sys.stderr)
            return 1
        results.append(json.loads(line[len("PROFILE_RESULT "):]))
    png = str(stacked_png(results, a.png)) if a.png is not None else None
    if a.json:
        print(json.dumps({"results": results, "phases": list(PHASES), "png": png,
                          "argv": sys.argv[1:] if argv is None else argv}))
        return 0
    print(_table(results))
    if png:
        print(f"chart: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
