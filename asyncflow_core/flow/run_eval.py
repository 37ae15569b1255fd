"""Validation during a run: the eval queue on the rollout replicas, the evaluator and the scheduler that pins each
evaluation to a published version (``flow/eval.py``), attached by the runtime when the config has an ``eval``
section; and the last rounds, run on the newest weights once training has ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncflow_core.flow.events import VersionPublished

log = logging.getLogger("asyncflow.flow")


def attach_eval(rt: Any, ctx: Any, rollout: Any, reward: Any, tokenizer: Any, dataset: Any,
                metrics: Any, step_log: Any, sampling: Any, clock: Any) -> Any:
    """With an ``eval`` section: the queue on the rollout replicas, the evaluator and the scheduler that asks for an
    evaluation pinned to every N-th published version. Returns the queue (None without the section).

    The evaluator draws no ``eval.png`` during the run: matplotlib would block the event loop (rollouts and
    training) for a third of a second per round, and a second and a half the first time; the run's files at the
    end draw it from ``metrics.jsonl`` (:func:`~asyncflow_core.flow.run_report.write_run_files`)."""
    cfg = rt.config
    if cfg.eval is None:
        return None
    from asyncflow_core.flow.eval import EvalRequests, EvalScheduler, Evaluator, eval_sampling, load_eval_sets

    t0 = ctx.timeline.t0
    evaluator = Evaluator(reward, tokenizer, cfg.eval, writer=metrics, sinks=step_log.sinks, run_dir=rt.run_dir,
                          timeout_s=cfg.reward.timeout_s, png=False, clock=lambda: clock() - t0)
    rollout.eval = EvalRequests(eval_sampling(cfg.eval, cfg.rollout, sampling.stop_token_ids),
                                max_inflight=cfg.rollout.max_inflight, priority=cfg.eval.priority,
                                on_complete=evaluator.evaluate)
    sched = EvalScheduler(cfg.eval, load_eval_sets(rt.resolved, tokenizer, dataset), rollout.eval,
                          total_steps=cfg.trainer.total_steps)
    sched.start()
    ctx.events.subscribe(VersionPublished, sched.on_version_published, name="eval")
    return rollout.eval


async def finish_evals(queue: Any, rollout: Any, ctx: Any, max_inflight: int) -> None:
    """After training: load the newest weights into the live replicas and run every open eval round."""
    from asyncflow_core.flow.eval import finish_rounds

    live = [r for r in rollout.replicas if not r.dead]

    async def load_latest() -> None:
        await asyncio.gather(*(rollout.load_weights(r, min_version=ctx.published)
                               for r in live if r.engine.version < ctx.published))

    try:
        await finish_rounds(queue, [r.engine for r in live], max_inflight=max_inflight, load_latest=load_latest)
    except Exception as exc:  # noqa: BLE001 - the run's training results are safe; say why the last eval is missing
        log.warning("the final evaluation did not run: %s: %s", type(exc).__name__, exc)
