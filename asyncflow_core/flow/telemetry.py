"""Telemetry of a run: busy spans per lane, a Perfetto/Chrome trace, a Gantt PNG, and metrics JSONL.

Every stage and engine instance is a *lane*; whatever it spends time on
(generating, scoring, a train step, a weight transfer, waiting for admission)
is a span ``[start, end)`` on the run's clock — the event loop's clock, so a
simulated run's spans are in simulated seconds. Idle time is what lies
between spans. ``utilisation`` gives each lane's busy fraction over a window.

Everything written to the run directory passes through a
:class:`~asyncflow_core.config.redact.Redactor` (the process's default one
unless given): a secret that reached a lane name, a metric or an error
string is replaced before it touches the disk (docs/security.md).
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import json
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncflow_core.config.redact import Redactor, default_redactor

#: spans that show a lane *waiting* (drawn on the timeline, not counted as busy)
WAIT_SPANS = frozenset({"admission_wait", "wait_batch"})


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    #: what the span was about (an environment call's row and turn, its seconds), shown in the trace
    args: Mapping[str, Any] | None = field(default=None, compare=False)


#: lists that :func:`observe_timelines` blocks collect new timelines into
_observers: list[list[Timeline]] = []


@contextlib.contextmanager
def observe_timelines() -> Iterator[list[Timeline]]:
    """Every :class:`Timeline` created inside the block, in order (a profiler reads a run's spans live).

    A run's spans are on its clock (``t0`` is that clock at the timeline's
    creation; for a real run ``loop.time``, i.e. ``time.monotonic``), so a
    profiler can line them up with measurements taken in other processes.
    """
    found: list[Timeline] = []
    _observers.append(found)
    try:
        yield found
    finally:
        _observers.remove(found)


#: environment-call spans kept per slot-lane prefix (``env``); later calls are not drawn (see ``slot_span``)
MAX_SLOT_SPANS = 20_000


class Timeline:
    """Collects spans; ``clock`` is the run's clock (``loop.time``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.spans: list[Span] = []
        #: the latest end among ``spans[:i + 1]`` (nondecreasing): a window's scan starts at the first span that
        #: can reach into it, so each step's utilisation costs the spans since the step began, not the whole run
        self._reach: list[float] = []
        self._reach_of = self.spans  #: the list ``_reach`` indexes
        self.t0 = clock()
        self._free: dict[str, list[int]] = defaultdict(list)  # prefix -> free slot lanes (a heap)
        self._slots: dict[str, int] = defaultdict(int)  # prefix -> slot lanes made so far
        self._slot_spans: dict[str, int] = defaultdict(int)  # prefix -> slot spans recorded (capped)
        for found in _observers:
            found.append(self)

    def add(self, lane: str, name: str, start: float, end: float, args: Mapping[str, Any] | None = None) -> None:
        if end > start:
            self.spans.append(Span(lane, name, start, end, args))
            self._reach.append(end if not self._reach or end > self._reach[-1] else self._reach[-1])

    @contextlib.contextmanager
    def span(self, lane: str, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(lane, name, start, self.clock())

    @contextlib.contextmanager
    def slot_span(self, prefix: str, name: str, args: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """A span on the lowest ``<prefix>/<k>`` lane free now: concurrent calls (environment steps of many
        episodes) each get a lane of their own, so no lane holds overlapping spans and ``<prefix>/0`` is busy
        whenever at least one call runs. Yields ``args`` (the caller may add to it before the span ends)."""
        out = {} if args is None else args
        if self._slot_spans[prefix] >= MAX_SLOT_SPANS:
            # a long multi-turn run makes millions of environment calls: the trace keeps the first ones, and
            # each step's utilisation (a scan of every span) stays cheap; the episode_* columns count them all
            yield out
            return
        self._slot_spans[prefix] += 1
        free = self._free[prefix]
        if free:
            k = heapq.heappop(free)
        else:
            k = self._slots[prefix]
            self._slots[prefix] += 1
        start = self.clock()
        try:
            yield out
        finally:
            self.add(f"{prefix}/{k}", name, start, self.clock(), out)
            heapq.heappush(free, k)

    def lanes(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.spans:
            seen.setdefault(s.lane, None)
        return sorted(seen, key=_lane_order)

    def busy(self, start: float, end: float) -> dict[str, float]:
        """Busy seconds per lane inside ``[start, end)`` (overlapping spans merged; waiting spans not counted)."""
        per: dict[str, list[tuple[float, float]]] = defaultdict(list)
        if self._reach_of is not self.spans or len(self._reach) != len(self.spans):  # a list set wholesale
            self._reach, self._reach_of = list(itertools.accumulate((s.end for s in self.spans), max)), self.spans
        for s in self.spans[bisect.bisect_right(self._reach, start):]:
            if s.name in WAIT_SPANS:
                continue
            a, b = max(s.start, start), min(s.end, end)
            if b > a:
                per[s.lane].append((a, b))
        out: dict[str, float] = {}
        for lane, ivs in per.items():
            ivs.sort()
            total, cur_a, cur_b = 0.0, ivs[0][0], ivs[0][1]
            for a, b in ivs[1:]:
                if a > cur_b:
                    total += cur_b - cur_a
                    cur_a, cur_b = a, b
                else:
                    cur_b = max(cur_b, b)
            out[lane] = total + cur_b - cur_a
        return out

    def utilisation(self, start: float, end: float) -> dict[str, float]:
        width = end - start
        return {lane: (b / width if width > 0 else 0.0) for lane, b in self.busy(start, end).items()}

    # -- exports ------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome / Perfetto trace-event JSON (open it at ui.perfetto.dev): one thread per lane."""
        tids = {lane: i + 1 for i, lane in enumerate(self.lanes())}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "asyncflow run"}},
        ]
        for lane, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        for s in self.spans:
            event = {
                "ph": "X", "pid": 1, "tid": tids[s.lane], "name": s.name,
                "ts": (s.start - self.t0) * 1e6, "dur": (s.end - s.start) * 1e6,
            }
            if s.args:
                event["args"] = dict(s.args)
            events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def redacted(self, redactor: Redactor | None = None) -> Timeline:
        """The timeline with lane and span names through ``redactor`` (``self`` when no name changes)."""
        r = redactor or default_redactor()
        names = {s.lane for s in self.spans} | {s.name for s in self.spans}
        clean = {text: r.text(text) for text in names}
        if all(clean[text] == text for text in names):
            return self  # the common case: nothing to replace, no copy of a million spans
        out = Timeline(self.clock)
        out.t0 = self.t0
        out.spans = [Span(clean[s.lane], clean[s.name], s.start, s.end, s.args) for s in self.spans]
        return out

    def write(self, run_dir: Path, *, redactor: Redactor | None = None) -> Path:
        """Write ``trace.json`` (Chrome/Perfetto) and ``spans.jsonl`` (for ``asyncflow trace``), secrets redacted."""
        clean = self.redacted(redactor)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "trace.json"
        path.write_text(json.dumps(clean.chrome_trace()))
        with (run_dir / "spans.jsonl").open("w") as fh:
            for s in clean.spans:
                d = {"lane": s.lane, "name": s.name, "start": s.start - self.t0, "end": s.end - self.t0}
                if s.args:
                    d["args"] = dict(s.args)
                fh.write(json.dumps(d) + "\n")
        return path


def _lane_order(lane: str) -> tuple[int, str]:
    order = ("feeder", "rollout", "reward", "ref", "old", "values", "advantage", "train", "weights")
    for i, prefix in enumerate(order):
        if lane.startswith(prefix):
            return (i, lane)
    return (len(order), lane)


def load_spans(run_dir: Path) -> list[Span]:
    path = Path(run_dir) / "spans.jsonl"
    if not path.is_file():
        from asyncflow_core.errors import ConfigError

        raise ConfigError(f"{run_dir} holds no spans.jsonl; pass the run_dir of a run (logging.run_dir)")
    out = []
    with path.open() as fh:
        for line in fh:
            d = json.loads(line)
            out.append(Span(d["lane"], d["name"], float(d["start"]), float(d["end"]), d.get("args")))
    return out


_COLOURS = {
    "generate": "#4C72B0", "score": "#55A868", "train_step": "#C44E52", "logprobs": "#8172B2",
    "send_weights": "#CCB974", "update_weights": "#DD8452", "advantages": "#64B5CD", "admission_wait": "#BBBBBB",
    "sleep": "#999999", "reset": "#937860", "step": "#DA8BC3",
}


def gantt_png(spans: list[Span], path: Path, *, title: str = "asyncflow timeline", max_lanes: int = 48) -> Path:
    """Render spans as a Gantt chart (one row per lane) to ``path``. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - matplotlib is a core dependency
        from asyncflow_core.errors import ConfigError

        raise ConfigError("rendering the Gantt PNG needs matplotlib: pip install matplotlib") from exc
    lanes: dict[str, None] = {}
    for s in spans:
        lanes.setdefault(s.lane, None)
    names = sorted(lanes, key=_lane_order)
    if len(names) > max_lanes:  # keep the picture readable: first lanes of each kind
        names = names[:max_lanes]
    row = {lane: i for i, lane in enumerate(names)}
    fig, ax = plt.subplots(figsize=(14, 0.35 * len(names) + 1.5))
    by_name: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for s in spans:
        if s.lane in row:
            by_name[s.name].append((s.start, s.end - s.start, row[s.lane]))
    for name, items in by_name.items():
        colour = _COLOURS.get(name, "#777777")
        for y in set(i[2] for i in items):
            ax.broken_barh([(a, w) for a, w, r in items if r == y], (y - 0.4, 0.8), facecolors=colour)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (run clock)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=_COLOURS.get(n, "#777777"), label=n) for n in sorted(by_name)],
              loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class MetricsWriter:
    """One JSON object per line (``metrics.jsonl``), flushed as written; secrets redacted on the way out."""

    def __init__(self, path: Path | None, *, append: bool = False, redactor: Redactor | None = None) -> None:
        self.path = path
        self.redactor = redactor
        self.records: list[dict[str, Any]] = []
        self._fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._fh is not None:
            self._fh.write(json.dumps((self.redactor or default_redactor()).value(record)) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def reward_png(metrics: Path | list[dict[str, Any]], path: Path, *, title: str = "reward",
               series: dict[str, list[dict[str, Any]]] | None = None) -> Path:
    """Mean reward per step (from ``metrics.jsonl`` records) as a line plot; ``series`` overlays several runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if series is None:
        records = load_metrics(metrics) if isinstance(metrics, Path) else metrics
        series = {"reward": records}
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, records in series.items():
        pts = [(r["step"], r["reward_mean"]) for r in records if "reward_mean" in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line, from a killed run, is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
