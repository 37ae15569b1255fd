"""Running a run's stages to the end, and tearing everything down in order whatever the end was."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.flow.stage import FlowContext, Stage
from asyncflow_core.flow.final_model import complete_final_model

log = logging.getLogger("asyncflow.flow")

__all__ = ["quietly", "supervise", "teardown"]


async def supervise(ctx: FlowContext, stages: Sequence[Stage], *, start: Callable[[], Awaitable[None]],
                    stop: Callable[[bool], Awaitable[None]],
                    lost: Callable[[], Awaitable[None]]) -> tuple[bool, BaseException | None]:
    """``start()``, run every stage as a task until all end, the run halts, or one raises; then ``stop(clean)``.

    ``lost()`` raises when a role the run needs is gone (the launcher's
    watch). Returns ``(interrupted, error)``: a KeyboardInterrupt or
    cancellation, or the first exception; the context is halted with the
    reason either way. Every task is cancelled and awaited before ``stop``,
    so a stage never runs against a closed component.
    """
    interrupted = False
    error: BaseException | None = None
    tasks: dict[asyncio.Future, Stage | None] = {}
    try:
        await start()
        tasks.update({asyncio.ensure_future(st.run()): st for st in stages})
        stop_task = asyncio.ensure_future(ctx.stop.wait())
        tasks[stop_task] = None
        tasks[asyncio.ensure_future(lost())] = None  # raises when a role the run needs is gone
        pending = set(tasks)
        while pending and not ctx.stop.is_set():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is stop_task or t.cancelled():
                    continue
                exc = t.exception()
                if exc is not None:
                    raise exc
            if not any(tasks[t] is not None for t in pending):
                break
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
        ctx.halt("interrupted")
    except BaseException as exc:  # noqa: BLE001 - reported after the telemetry is written
        error = exc
        ctx.halt(f"{type(exc).__name__}: {exc}")
    finally:
        # stop every stage before closing what they use, and collect their exceptions (none left unretrieved)
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        await stop(error is None and not interrupted)
    return interrupted, error


async def teardown(cfg: Any, ctx: FlowContext, *, canary: Any, rollout: Any, step_log: Any, store: Any,
                   transport: Any, replicas: Sequence[Any], reward: Any, trainer: Any, ref_engine: Any,
                   metrics: Any, run_dir: Path | None, export: bool) -> None:
    """Close every component, each failure logged and the next one still closed; with ``export`` (a clean end)
    and ``trainer.export_final``, write the final model first."""
    if canary is not None:
        await canary.close()
    rollout.close_spans()
    step_log.close()
    await quietly(store.close())
    await quietly(transport.close())
    for r in replicas:
        await quietly(r.shutdown())
    if asyncio.iscoroutinefunction(getattr(reward, "shutdown", None)):  # a remote reward pool
        await quietly(reward.shutdown())
    if cfg.trainer.export_final and run_dir is not None and export and trainer.version > 0:
        try:
            await trainer.export_pretrained(run_dir / "final_model")
            # the checkpoint's tokenizer, chat template and generation config go with it: final_model/ loads with
            # AutoModelForCausalLM and AutoTokenizer and renders the same prompts
            complete_final_model(cfg.model, run_dir / "final_model")
        except UnsupportedFeatureError:
            pass
        except Exception as exc:  # noqa: BLE001 - the run's results are already safe
            log.warning("final export failed: %s: %s", type(exc).__name__, exc)
    await quietly(trainer.shutdown())
    if ref_engine is not None:
        await quietly(ref_engine.shutdown())
    metrics.close()


async def quietly(coro: Any) -> None:
    """Await ``coro``; an exception is logged, not raised (teardown must reach every component)."""
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - teardown must reach every component
        log.warning("teardown: %s: %s", type(exc).__name__, exc)
