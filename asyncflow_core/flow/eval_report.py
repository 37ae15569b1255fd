"""Scoring an evaluation round (a ``flow/eval.py`` ``EvalRound``): pass@k (unbiased), the per-set metrics,
the :class:`Evaluator` that writes each round's record tagged with the version it measured, and the
records' curve (``eval.png``).

The queue, the rounds and the scheduler that pins evaluations to versions are in :mod:`asyncflow_core.flow.eval`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.flow.reward_stage import score_each
from asyncflow_core.flow.telemetry import MetricsWriter, load_metrics
from asyncflow_core.types import RewardInput

log = logging.getLogger("asyncflow.flow")

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` samples correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def set_metrics(scored: list[tuple[int, float, int, float | None]], *, metrics: Sequence[str], k: int,
                threshold: float) -> dict[str, float]:
    """Metrics of one set from ``(prompt index, reward, completion tokens, answer_found or None)`` per sample."""
    per: dict[int, list[float]] = {}
    for idx, reward, _, _ in scored:
        per.setdefault(idx, []).append(reward)
    out: dict[str, float] = {}
    for m in metrics:
        if m.startswith("pass@"):
            kk = k if m == "pass@k" else int(m[5:])
            name = f"pass@{kk}"
            vals = [pass_at_k(len(rs), sum(r >= threshold for r in rs), kk) for rs in per.values() if len(rs) >= kk]
            if vals:
                out[name] = sum(vals) / len(vals)
        elif m == "mean_reward" and scored:
            out[m] = sum(s[1] for s in scored) / len(scored)
        elif m == "mean_length" and scored:
            out[m] = sum(s[2] for s in scored) / len(scored)
        elif m == "format_rate":
            found = [s[3] for s in scored if s[3] is not None]
            if found:
                out[m] = sum(found) / len(found)
    return out


class Evaluator:
    """Scores finished rounds with the run's reward, and writes their metrics (see the module docstring)."""

    def __init__(self, reward: Any, tokenizer: Any, config: Any, *, writer: MetricsWriter | None = None,
                 sinks: Sequence[Callable[[int, dict[str, float]], Any]] = (), run_dir: Path | None = None,
                 timeout_s: float = 60.0, png: bool = True, clock: Callable[[], float] | None = None) -> None:
        self.reward = reward
        self.tokenizer = tokenizer
        self.config = config
        self.writer = writer
        self.sinks = list(sinks)
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.png = png
        self.clock = clock
        self.records: list[dict[str, Any]] = []
        #: fields added to every record (``asyncflow eval``: where the weights came from)
        self.tags: dict[str, Any] = {}

    async def _score(self, samples: list[RewardInput]) -> list[tuple[bool, Any]]:
        score_many = getattr(self.reward, "score_many", None)
        if callable(score_many):
            return list(await score_many(samples, self.timeout_s))
        return await score_each(self.reward, samples, self.timeout_s)

    async def evaluate(self, rnd: Any) -> dict[str, Any]:
        """The round's metrics record (written where the run writes metrics); returned too."""
        cfg = self.config
        done = [(rnd.by_id[rid], res) for rid, res in rnd.results.items()]
        samples = []
        for it, res in done:
            ids = res.token_ids.tolist() if isinstance(res.token_ids, torch.Tensor) else list(res.token_ids)
            rec = it.prompt.record
            samples.append(RewardInput(prompt=rec.prompt, completion=self.tokenizer.decode(ids),
                                       prompt_token_ids=it.prompt.prompt_ids, completion_token_ids=tuple(ids),
                                       metadata=dict(rec.metadata)))
        answers = await self._score(samples)
        by_set: dict[str, list[tuple[int, float, int, float | None]]] = {}
        failed: dict[str, int] = {}
        for it in rnd.items:
            by_set.setdefault(it.prompt.label, [])
        for rid in list(rnd.failed) + list(rnd.mismatched):
            failed[rnd.by_id[rid].prompt.label] = failed.get(rnd.by_id[rid].prompt.label, 0) + 1
        for (it, res), (ok, value) in zip(done, answers, strict=True):
            found = None
            if ok and isinstance(value, Mapping):
                found = float(value["answer_found"]) if "answer_found" in value else None
                value = value.get("reward")
            try:
                reward = float(value) if ok else math.nan
            except (TypeError, ValueError):
                reward = math.nan
            if not math.isfinite(reward):
                failed[it.prompt.label] = failed.get(it.prompt.label, 0) + 1
                continue
            by_set[it.prompt.label].append((it.prompt.index, reward, len(res.token_ids), found))
        version = rnd.label_version if rnd.label_version is not None else rnd.version
        requested = rnd.requested if rnd.label_version is None else rnd.label_version
        record: dict[str, Any] = {"eval_version": version, "eval_requested": requested, **self.tags}
        if self.clock is not None:
            record["time_s"] = self.clock()
        for label, scored in by_set.items():
            values = set_metrics(scored, metrics=cfg.metrics, k=cfg.samples_per_prompt, threshold=cfg.pass_threshold)
            record.update({f"eval/{label}/{k}": v for k, v in values.items()})
            record[f"eval/{label}/samples"] = len(scored)
            record[f"eval/{label}/failed"] = failed.get(label, 0)
        record["eval/version_mismatch"] = len(rnd.mismatched)
        self.records.append(record)
        if self.writer is not None:
            self.writer.write(record)
        scalars = {k: float(v) for k, v in record.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        for sink in self.sinks:
            sink(int(version or 0), scalars)
        if self.png and self.run_dir is not None:
            eval_png(self.run_dir, self.records)
        return record


def eval_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every eval record of a run: ``metrics.jsonl``'s (during training) and ``eval.jsonl``'s (``asyncflow eval``)."""
    out: list[dict[str, Any]] = []
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = run_dir / name
        if path.is_file():
            out += [r for r in load_metrics(path) if "eval_version" in r]
    return out


def eval_png(run_dir: Path, records: list[dict[str, Any]] | None = None, *, path: Path | None = None) -> Path | None:
    """``eval.png``: every eval metric that is a rate or a reward, per set, against the version evaluated."""
    records = eval_records(run_dir) if records is None else records
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for key, v in r.items():
            if key.startswith("eval/") and key.rsplit("/", 1)[-1] not in ("samples", "failed", "mean_length") \
                    and key != "eval/version_mismatch" and isinstance(v, (int, float)):
                series.setdefault(key.removeprefix("eval/"), []).append((int(r["eval_version"]), float(v)))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in sorted(series.items()):
        pts = sorted(dict(pts).items())  # one point per version (the newest record wins)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("weight version (steps trained)")
    ax.set_ylabel("eval metric")
    ax.set_title("validation, pinned per version")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path or run_dir / "eval.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# -------------------------------------------------------------------------------------------- scheduling
