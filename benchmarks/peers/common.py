"""Figures both sides of a peer comparison report the same way (pure Python: it runs in either environment).

A run is a list of steps, each ``{"step", "end_s", "samples", "accuracy"}``
where ``end_s`` is seconds from the *start of the first step* to the end of
this one (start-up, model build and the first weight push excluded) and
``accuracy`` the step's exact-match fraction.
"""

from __future__ import annotations

from typing import Any

#: steps at which accuracy is reported (the mean of the window of steps ending there)
ACCURACY_STEPS = (25, 50, 100, 200, 300, 500)
WINDOW = 5


def learning_summary(steps: list[dict[str, Any]], *, level: float = 0.5) -> dict[str, Any]:
    """samples/s over every step, accuracy at fixed steps, seconds to ``level`` accuracy, final accuracy."""
    if not steps:
        raise ValueError("no steps to summarise")
    span = steps[-1]["end_s"]
    acc = [float(s["accuracy"]) for s in steps]

    def window(i: int) -> float:  # mean of the WINDOW steps ending at index i
        part = acc[max(0, i - WINDOW + 1): i + 1]
        return sum(part) / len(part)

    at = {str(n): window(n - 1) for n in ACCURACY_STEPS if n <= len(steps)}
    reached = next((steps[i]["end_s"] for i in range(len(steps)) if window(i) >= level), None)
    return {
        "steps": len(steps),
        "samples": sum(int(s["samples"]) for s in steps),
        "seconds": span,
        "samples_per_s": sum(int(s["samples"]) for s in steps) / span if span > 0 else 0.0,
        f"accuracy_{WINDOW}_step_mean_at": at,
        f"seconds_to_accuracy_{level:g}": reached,
        "final_accuracy": window(len(steps) - 1),
        "max_accuracy_window": max(window(i) for i in range(len(steps))),
    }
