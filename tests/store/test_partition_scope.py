"""Consumer tasks scoped to a partition: train and eval rows in one store, each collected by its own consumers."""

from __future__ import annotations

import pytest
import torch
from asyncflow_spec.base import run

from asyncflow_core.store.controller import Controller
from asyncflow_core.store.errors import InvalidRequestError
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.types import RaggedTensor


def _cols(n: int, base: int) -> dict:
    seqs = [torch.tensor([base + i, base + i], dtype=torch.int64) for i in range(n)]
    return {"response_ids": RaggedTensor.from_sequences(seqs, dtype=torch.int64)}


def _inprocess():
    return InProcessStore(capacity=64, lease_s=30.0)


def _multiprocess():
    from asyncflow_core.store.deployments.multiprocess import MultiprocessStore

    return MultiprocessStore.serve(arena_mb=8)


@pytest.mark.parametrize("make", [_inprocess, _multiprocess], ids=["inprocess", "multiprocess"])
def test_train_and_eval_partitions_are_leased_and_collected_independently(make):
    async def go():
        store = make()
        try:
            await store.register_task("rollout", produces=["response_ids"])
            # two consumers per partition: a partition's rows go once both of its own have acknowledged them
            for task in ("adv", "train"):
                await store.register_task(task, consumes=["response_ids"], partition="train")
            await store.register_task("eval_score", consumes=["response_ids"], partition="eval")
            await store.register_task("eval_log", consumes=["response_ids"], partition="eval")
            train = await store.put(_cols(4, 0), partition="train")
            evals = await store.put(_cols(3, 100), partition="eval")
            await store.end_stream("train")

            leases = {}
            for task in ("adv", "train"):  # partition=None: the task's scope decides
                m = await store.get_meta(task, ["response_ids"], 16, timeout=10)
                assert sorted(m.row_ids.tolist()) == sorted(train.row_ids.tolist())  # no eval row, ever
                got = await store.get(m)
                assert all(s[0] < 100 for s in got["response_ids"].to_list())
                leases[task] = m
            for task in ("eval_score", "eval_log"):
                m = await store.get_meta(task, ["response_ids"], 16, partial=True, timeout=10)
                assert sorted(m.row_ids.tolist()) == sorted(evals.row_ids.tolist())
                leases[task] = m

            async def live() -> int:
                return (await store.stats())["rows_live"]

            assert await live() == 7
            await store.ack(leases["adv"])
            assert await live() == 7  # train rows wait for "train" too
            await store.ack(leases["eval_score"])
            assert await live() == 7  # eval rows wait for "eval_log"
            await store.ack(leases["eval_log"])
            assert await live() == 4  # eval collected while train's rows are still held
            await store.ack(leases["train"])
            assert await live() == 0
            # train's stream ended and drained; eval's has not
            assert (await store.get_meta("train", ["response_ids"], 1, timeout=10)).end_of_stream
            await store.put(_cols(1, 200), partition="eval")
            m = await store.get_meta("eval_log", ["response_ids"], 1, timeout=10)
            assert len(m) == 1 and not m.end_of_stream
        finally:
            await store.close()

    run(go())


def test_a_scoped_task_cannot_lease_another_partition():
    c = Controller(16)
    c.register_task("p", produces=["x"])
    c.register_task("train", consumes=["x"], partition="train")
    c.add_rows(2, "eval")
    c.mark_ready(torch.arange(2), ["x"])
    with pytest.raises(InvalidRequestError, match="partition 'train' cannot lease rows of partition 'eval'"):
        c.try_lease("train", ["x"], 1, partition="eval")
    assert c.try_lease("train", ["x"], 1) is None  # eval rows are not train's
    c.end_stream("train")
    assert c.is_end_of_stream("train", ["x"])  # train's stream ended, eval rows notwithstanding
    assert not c.is_end_of_stream("p", ["x"]) and c.task_partition("train") == "train"


def test_scope_is_fixed_by_the_first_registration():
    c = Controller(16)
    c.register_task("train", consumes=["x"], partition="train")
    c.register_task("train", consumes=["y"])  # None keeps the scope
    assert c.task_partition("train") == "train" and c.tasks["train"][0] == ("x", "y")
    with pytest.raises(InvalidRequestError, match="re-registered"):
        c.register_task("train", partition="eval")
    c.register_task("all", consumes=["x"])
    with pytest.raises(InvalidRequestError, match="every partition"):
        c.register_task("all", partition="train")
    with pytest.raises(InvalidRequestError, match="partition must be"):
        c.register_task("bad", partition="")


def test_unscoped_consumers_still_hold_every_partition_and_uncovered_rows_stay():
    c = Controller(16)
    c.register_task("p", produces=["x"])
    c.register_task("all", consumes=["x"])
    c.register_task("ev", consumes=["x"], partition="eval")
    c.add_rows(2, "train")
    c.add_rows(2, "eval")
    c.mark_ready(torch.arange(4), ["x"])
    m = c.try_lease("all", ["x"], 4)
    c.ack(m.lease_id)
    assert c.gc().tolist() == [0, 1]  # train rows: only "all" covers them; eval rows also wait for "ev"
    m = c.try_lease("ev", ["x"], 2)
    c.ack(m.lease_id)
    assert c.gc().tolist() == [2, 3]

    only_scoped = Controller(16)
    only_scoped.register_task("p", produces=["x"])
    only_scoped.register_task("ev", consumes=["x"], partition="eval")
    only_scoped.add_rows(2, "train")
    assert only_scoped.gc().numel() == 0  # no consumer covers train rows: never collected behind their back


def test_checkpoint_keeps_task_scopes_and_loads_old_checkpoints():
    c = Controller(16)
    c.register_task("p", produces=["x"])
    c.register_task("ev", consumes=["x"], partition="eval")
    c.add_rows(1, "train")
    c.add_rows(1, "eval")
    c.mark_ready(torch.arange(2), ["x"])
    state = c.state_dict()
    back = Controller(16)
    back.load_state_dict(state)
    assert back.task_partition("ev") == "eval"
    assert back.try_lease("ev", ["x"], 2, partial=True).row_ids.tolist() == [1]
    old = dict(state, tasks=[t[:3] for t in state["tasks"]])  # a checkpoint from before task scopes
    older = Controller(16)
    older.load_state_dict(old)
    assert older.task_partition("ev") is None


def test_sync_facade_passes_the_scope():
    from asyncflow_core.store.sync import SyncStore

    store = SyncStore(InProcessStore(capacity=8))
    try:
        store.register_task("p", produces=["response_ids"])
        store.register_task("ev", consumes=["response_ids"], partition="eval")
        assert store.store.controller.task_partition("ev") == "eval"
    finally:
        store.close()
