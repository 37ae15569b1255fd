"""What a run reports: the per-step metrics record and progress display, scalar sinks, and the run summary."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from asyncflow_core import columns as C
from asyncflow_core.config.redact import default_redactor, redact_config
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.reward_stage import reward_extras
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import MetricsWriter, Timeline, gantt_png, reward_png
from asyncflow_core.types import Batch

__all__ = ["StepLogger", "run_summary", "scalar_sinks", "steady_rate", "write_run_files"]


def steady_rate(step_ends: list[tuple[float, int]]) -> float | None:
    """Samples/s from the end of the first step to the end of the last: throughput without the pipeline fill.

    A pipelined run spends its first step filling the pipeline (nothing to
    train until the first batch is generated); a long run amortises that to
    nothing, so this is the figure a long run sees. None with fewer than two steps.
    """
    if len(step_ends) < 2 or step_ends[-1][0] <= step_ends[0][0]:
        return None
    return sum(n for _, n in step_ends[1:]) / (step_ends[-1][0] - step_ends[0][0])


class StepLogger:
    """Per-step metrics (JSONL) and the live progress display."""

    def __init__(self, ctx: FlowContext, writer: MetricsWriter, progress: bool, total: int,
                 sinks: list[Any] | None = None) -> None:
        self.ctx = ctx
        self.sinks = sinks or []
        self.writer = writer
        self.tokens = 0
        self.total = total
        self.step_ends: list[tuple[float, int]] = []  #: (clock at the end of each step, samples it trained)
        self.extras: list[Any] = []  #: callables returning more figures for the step's record (the canary's)
        self._last_end = ctx.clock()
        self._last_counters: Counter[str] = Counter()
        self._progress = None
        self._task = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn())
            self._progress.start()
            self._task = self._progress.add_task("steps", total=total, info="")

    def started(self) -> None:
        self._last_end = self.ctx.clock()

    async def on_step(self, event: VersionPublished) -> None:
        """The step's metrics record (a ``VersionPublished`` subscriber)."""
        ctx = self.ctx
        version, batch, metrics, report, lag = event.step, event.batch, event.metrics, event.report, event.lag
        now = ctx.clock()
        resp = batch[C.RESPONSE_IDS]
        prompt = batch[C.PROMPT_IDS]
        tokens = int(resp.numel_packed + prompt.numel_packed)  # type: ignore[union-attr]
        self.tokens += tokens
        width = now - self._last_end
        counters = Counter({k: v for k, v in ctx.counters.items()})
        counters.update(ctx.ledger.counters)
        delta = {k: int(v - self._last_counters.get(k, 0)) for k, v in counters.items() if v != self._last_counters.get(k, 0)}
        self._last_counters = counters
        hist = Counter(lag.tolist())
        extra = reward_extras(batch)
        episodes = episode_figures(batch)
        util = ctx.timeline.utilisation(self._last_end, now)
        record = {
            "step": version + 1,
            "time_s": now - ctx.timeline.t0,
            "step_seconds": width,
            "reward_mean": float(batch[C.REWARD].float().mean()),
            **{f"reward/{k}": v for k, v in extra.items()},
            **{f"episode/{k}": v for k, v in episodes.items()},
            "samples": batch.num_rows,
            "tokens": tokens,
            "tokens_per_s": tokens / width if width > 0 else 0.0,
            "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
            "weight_sync_s": report.seconds,
            "weight_bytes": report.bytes,
            "events": delta,
            "utilisation": {k: round(v, 4) for k, v in sorted(util.items())},
            **{f"train/{k}": float(v) for k, v in metrics.items()},
            **{k: v for extra_fn in self.extras for k, v in extra_fn().items()},
        }
        self.writer.write(record)
        self.step_ends.append((now, batch.num_rows))
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
        for sink in self.sinks:
            sink(version + 1, scalars)
        self._last_end = now
        if self._progress is not None:
            self._progress.update(self._task, completed=version + 1,
                                  info=f"reward {record['reward_mean']:.3f}  {record['tokens_per_s']:.0f} tok/s")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def scalar_sinks(cfg: Any, run_dir: Path | None) -> list[Any]:
    """Optional scalar sinks: TensorBoard event files and W&B, each only when asked for and installed."""
    sinks: list[Any] = []
    if cfg.logging.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("logging.tensorboard needs the tensorboard package: pip install tensorboard") from exc
        writer = SummaryWriter(str((run_dir or Path(".")) / "tensorboard"))
        sinks.append(lambda step, scalars: [writer.add_scalar(k, v, step) for k, v in scalars.items()])
    if cfg.logging.wandb_project:
        try:
            import wandb  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError("logging.wandb_project needs wandb: pip install wandb") from exc
        wandb.init(project=cfg.logging.wandb_project, name=cfg.name,
                   config=redact_config(cfg.model_dump(mode="json", by_alias=True)))
        sinks.append(lambda step, scalars: wandb.log(scalars, step=step))
    return sinks


def run_summary(ctx: FlowContext, *, steps: int, sim0: float, sim_s: float, wall_s: float, step_log: StepLogger,
                staleness_hist: Counter[int], k: int) -> dict[str, Any]:
    """The run's summary (``summary.json``), with secrets scrubbed."""
    trained_samples = len(ctx.ledger.trained) * ctx.n
    summary = {
        "steps": int(steps),
        "stop_reason": ctx.stop_reason,
        "run_seconds": sim_s,
        "wall_seconds": wall_s,
        "samples_trained": trained_samples,
        "samples_per_s": trained_samples / sim_s if sim_s > 0 else 0.0,
        "steady_samples_per_s": steady_rate(step_log.step_ends),
        "step_end_s": [round(t - sim0, 6) for t, _ in step_log.step_ends],
        "tokens_trained": step_log.tokens,
        "staleness_histogram": {str(k_): v for k_, v in sorted(staleness_hist.items())},
        "max_staleness": k,
        "ledger": ctx.ledger.summary(),
        "counters": {k_: int(v) for k_, v in sorted(ctx.counters.items())},
        "utilisation": ctx.timeline.utilisation(sim0, sim0 + sim_s),
    }
    return default_redactor().value(summary)  # a stop reason may quote a secret


def write_run_files(run_dir: Path, summary: dict[str, Any], timeline: Timeline, *, write_png: bool, name: str,
                    title: str) -> None:
    """The trace, ``summary.json`` and (``write_png``) the reward, eval and timeline plots, in ``run_dir``."""
    timeline.write(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if write_png and (run_dir / "metrics.jsonl").exists():
        reward_png(run_dir / "metrics.jsonl", run_dir / "reward.png", title=f"{name}: mean reward")
        from asyncflow_core.flow.eval_report import eval_png

        eval_png(run_dir)  # validation records, when the run had an eval section (none: no file)
    if write_png:
        gantt_png(timeline.spans and [s.__class__(s.lane, s.name, s.start - timeline.t0, s.end - timeline.t0)
                                      for s in timeline.spans] or [], run_dir / "timeline.png", title=title)


def episode_figures(batch: Batch) -> dict[str, float]:
    """Means over a step's episodes (multi-turn rollouts): turns, tool calls and their success rate, seconds in
    the environment, the fraction of response tokens the loss skips; seconds in tools and the share correct
    over the episodes that reported them. Empty for single-turn batches."""
    if C.EPISODE_TURNS not in batch or batch.num_rows == 0:
        return {}
    out = {"turns": float(batch[C.EPISODE_TURNS].float().mean())}
    if C.EPISODE_TOOL_CALLS in batch:
        calls = float(batch[C.EPISODE_TOOL_CALLS].sum())
        out["tool_calls"] = calls / batch.num_rows
        if C.EPISODE_TOOL_OK in batch and calls:
            out["tool_ok_rate"] = float(batch[C.EPISODE_TOOL_OK].sum()) / calls
    if C.EPISODE_ENV_S in batch:
        out["env_s"] = float(batch[C.EPISODE_ENV_S].float().mean())
    if C.EPISODE_MASKED_FRAC in batch:
        out["masked_frac"] = float(batch[C.EPISODE_MASKED_FRAC].float().mean())
    for name, key in ((C.EPISODE_TOOL_S, "tool_s"), (C.EPISODE_CORRECT, "correct")):
        if name in batch:  # only the episodes that reported it count (NaN: not reported); absent when none did
            values = batch[name].float()
            values = values[~values.isnan()]
            if values.numel():
                out[key] = float(values.mean())
    return out
