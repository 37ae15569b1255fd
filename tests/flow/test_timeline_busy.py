"""``Timeline.busy``: the indexed scan (spans from the first that can reach the window) against a scan of all."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from asyncflow_core.flow.telemetry import WAIT_SPANS, Span, Timeline


def _busy_all(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Busy seconds per lane over every span: the definition, without the index."""
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        a, b = max(s.start, start), min(s.end, end)
        if s.name not in WAIT_SPANS and b > a:
            per[s.lane].append((a, b))
    out = {}
    for lane, ivs in per.items():
        covered, reach = 0.0, float("-inf")
        for a, b in sorted(ivs):
            covered += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        out[lane] = covered
    return out


@pytest.mark.parametrize("seed", range(6))
def test_every_window_counts_what_a_scan_of_every_span_counts(seed):
    rng = random.Random(seed)
    tl = Timeline(lambda: 0.0)
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(20.0)
        # most spans end now (added on exit); some are added late with an older end (another thread's, a rank's)
        end = now - (rng.uniform(0, 2.0) if rng.random() < 0.2 else 0.0)
        start = end - rng.expovariate(rng.choice([50.0, 5.0, 0.5]))  # short, medium and long spans
        tl.add(rng.choice(["rollout/0", "train", "reward"]), rng.choice(["generate", "train_step", "admission_wait"]),
               start, end)
    windows = [(0.0, now)] + [tuple(sorted((rng.uniform(0, now), rng.uniform(0, now)))) for _ in range(40)]
    for a, b in windows:
        got, want = tl.busy(a, b), _busy_all(tl.spans, a, b)
        assert got.keys() == want.keys()
        for lane in want:
            assert got[lane] == pytest.approx(want[lane], rel=1e-12, abs=1e-12)
    # spans set wholesale (a redacted copy) are indexed again
    copy = tl.redacted()
    assert copy.busy(*windows[1]) == pytest.approx(_busy_all(copy.spans, *windows[1]))
    for spans in (copy.spans[:100], list(reversed(copy.spans))):
        copy.spans = spans
        for a, b in windows:
            assert copy.busy(a, b) == pytest.approx(_busy_all(spans, a, b), rel=1e-12, abs=1e-12)
