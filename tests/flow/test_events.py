"""Run events (flow/events.py): subscribers of ``VersionPublished`` run one after the other in subscription order,
the context's wake-up (weight sync) first, the metrics before the checkpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.flow.checkpoint import Checkpointer, latest_checkpoint
from asyncflow_core.flow.events import Events, VersionPublished
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.runtime import FlowRuntime
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.types import Batch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"


def event(version: int) -> VersionPublished:
    return VersionPublished(version=version, staged=version, step=version - 1, batch=Batch({"x": torch.zeros(1)}),
                            metrics={}, report=None, lag=torch.zeros(1, dtype=torch.int64), t_begin=0.0)


def context() -> FlowContext:
    return FlowContext(store=None, timeline=Timeline(lambda: 0.0), ledger=Ledger(), k=1, prompts_per_step=1, n=1,
                       clock=lambda: 0.0)


def test_subscribers_run_in_order_each_finished_before_the_next():
    log: list[str] = []

    async def slow(e: VersionPublished) -> None:
        log.append(f"slow {e.version} start")
        await asyncio.sleep(0.01)
        log.append(f"slow {e.version} end")

    bus = Events()
    bus.subscribe(VersionPublished, slow, name="slow")
    bus.subscribe(VersionPublished, lambda e: log.append(f"plain {e.version}"), name="plain")
    bus.subscribe(int, lambda e: log.append("an int"), name="other type")
    asyncio.run(bus.publish(event(3)))
    assert log == ["slow 3 start", "slow 3 end", "plain 3"]
    assert bus.subscribers(VersionPublished) == ["slow", "plain"]


def test_a_failing_subscriber_stops_delivery_and_reaches_the_publisher():
    log: list[str] = []

    def broken(e: VersionPublished) -> None:
        raise OSError("disk full")

    bus = Events()
    bus.subscribe(VersionPublished, broken, name="checkpoint")
    bus.subscribe(VersionPublished, lambda e: log.append("after"), name="after")
    with pytest.raises(OSError, match="disk full"):
        asyncio.run(bus.publish(event(1)))
    assert log == []


def test_publishing_adds_no_task_switch():
    # what subscribers do not await runs before anything else: the train stage's order of events is kept
    log: list[str] = []

    async def quick(e: VersionPublished) -> None:
        log.append("quick")

    async def main() -> None:
        bus = Events()
        bus.subscribe(VersionPublished, quick, name="quick")
        async def other_task() -> None:
            log.append("other task")

        other = asyncio.ensure_future(other_task())
        await bus.publish(event(1))
        log.append("published")
        await other

    asyncio.run(main())
    assert log == ["quick", "published", "other task"]


def test_the_context_wakes_its_waiters_first():
    async def main() -> None:
        ctx = context()
        assert ctx.events.subscribers(VersionPublished) == ["context"]
        seen: list[int] = []
        waiter = asyncio.ensure_future(ctx.wait_for(lambda: ctx.published >= 2))
        await asyncio.sleep(0)
        ctx.events.subscribe(VersionPublished, lambda e: seen.append(len(ctx.waiting)), name="after")
        ctx.published = 2  # the train stage sets it, then publishes
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing woke it yet
        await ctx.events.publish(event(2))
        await asyncio.sleep(0)
        assert waiter.done()
        assert seen == [0]  # the context's wake-up had already resolved the waiter when the next subscriber ran

    asyncio.run(main())


class _Trainer:
    def __init__(self) -> None:
        self.saves: list[Path] = []

    async def save(self, path: Path) -> None:
        path.mkdir(parents=True)
        self.saves.append(path)


def test_checkpoints_every_nth_version_and_the_last_under_the_trainer_lock(tmp_path):
    async def main() -> list[str]:
        lock = asyncio.Lock()
        timeline = Timeline(asyncio.get_running_loop().time)
        ckpt = Checkpointer(tmp_path, _Trainer(), Ledger(), {"size": 1}, lambda: 42, every=2, total_steps=5, keep=10,
                            lock=lock, timeline=timeline)
        for v in range(1, 5):
            await ckpt.on_version_published(event(v))
        async with lock:  # the trainer is busy: the save waits for it
            task = asyncio.ensure_future(ckpt.on_version_published(event(5)))
            await asyncio.sleep(0.01)
            assert not task.done()
        await task
        assert {s.lane for s in timeline.spans} <= {"train"}
        return sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))

    assert asyncio.run(main()) == ["step_000002", "step_000004", "step_000005"]
    state = latest_checkpoint(tmp_path)[1]
    assert state.version == 5 and state.tokens_trained == 42 and state.data == {"size": 1}


def test_a_run_subscribes_canary_metrics_then_checkpoint_and_checkpoints_hold_the_steps_tokens(tmp_path):
    resolved = resolve(load_config(EXAMPLE, ["trainer.total_steps=4", "trainer.checkpoint_every=2", "canary.every=2",
                                             "canary.samples=2", "trainer.export_final=false"]))
    runtime = FlowRuntime(resolved, run_dir=tmp_path, write_png=False)
    asyncio.run(runtime.run())
    assert runtime.ctx.events.subscribers(VersionPublished) == ["context", "canary", "metrics", "checkpoint"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the metrics of step 4 were written before its checkpoint: the checkpoint counts their tokens
    assert latest_checkpoint(tmp_path)[1].tokens_trained == sum(r["tokens"] for r in records) > 0
    assert any("canary/mean_abs_dlogp" in r for r in records)


def test_a_keyed_notify_checks_its_key_and_the_unkeyed_waiters_and_wakes_them_in_waiting_order():
    """A weight load (``notify(key)``) must not check every replica's wait (quadratic in replicas over a run)."""
    async def main() -> None:
        ctx = context()
        state = {"a": False, "b": False, "any": False}
        calls: list[str] = []
        woke: list[str] = []

        def pred(name: str):
            def check() -> bool:
                calls.append(name)
                return state[name]
            return check

        async def wait(name: str, key: object) -> None:
            await ctx.wait_for(pred(name), key=key)
            woke.append(name)

        tasks = [asyncio.ensure_future(wait("b", 2)), asyncio.ensure_future(wait("any", None)),
                 asyncio.ensure_future(wait("a", 1))]
        await asyncio.sleep(0)
        calls.clear()
        state["a"] = True  # a change under key 1
        await ctx.notify(2)
        assert sorted(calls) == ["any", "b"] and ctx.waiting_on.keys() == {1, 2}  # key 1 not looked at
        calls.clear()
        await ctx.notify(1)
        assert sorted(calls) == ["a", "any"] and ctx.waiting_on.keys() == {2}
        await asyncio.sleep(0)
        assert woke == ["a"]
        calls.clear()
        ctx.published = 1  # not announced yet: the next notify of any key checks every waiter
        await ctx.notify(3)
        assert sorted(calls) == ["any", "b"]
        calls.clear()
        await ctx.notify(3)
        assert calls == ["any"]
        state["b"] = state["any"] = True
        await ctx.notify()  # no key: every waiter, woken in the order they began waiting
        await asyncio.gather(*tasks)
        assert woke == ["a", "b", "any"] and ctx.waiting == [] and ctx.waiting_on == {}

    asyncio.run(main())
