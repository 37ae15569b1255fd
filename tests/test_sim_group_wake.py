"""A waiting whole-group lease is woken when a write may complete a group, and never misses one.

The simulator's advantage stage leases whole GRPO groups and used to retry
its lease on every reward write. The in-process store now asks
``Controller.may_complete_group`` instead of ``any_ready`` for such a lease
(docs/simulation.md, "Simulator speed"). A ``False`` that should have been
``True`` would leave a stage blocked forever, so random operation sequences
check it against a scan from scratch: it must say True whenever a group of a
written row has ``group_size`` eligible rows (and, with groups put together,
exactly then).
"""

from __future__ import annotations

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_core.store import Controller
from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_core.store.controller import FREE
from asyncflow_core.store.errors import LeaseError

GS = 4
COLS = ["response_ids", "reward"]


def _complete_by_scan(c: Controller, task: str, written: torch.Tensor, columns: list[str], gs: int) -> bool:
    """Some group of a written (live) row has ``gs`` rows free for ``task``, alive and ready: from the arrays."""
    n = c._n
    t = c._tasks[task]
    ok = (c._state[t.index][:n] == FREE) & c._alive[:n]
    for w, need in c._need_masks(columns):
        ok &= (c._ready[:n, w] & need) == need
    groups = c._group[:n]
    live_written = torch.isin(c._row_id[:n], written) & c._alive[:n]
    for g in groups[live_written & ok].unique().tolist():
        if g >= 0 and int((ok & (groups == g)).sum()) >= gs:
            return True
    return False


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "ready", "lease", "ack", "gc", "drop", "reuse"]), st.integers(0, 1 << 30)),
    min_size=1, max_size=50,
)


@settings(max_examples=80, deadline=None)
@given(OPS)
def test_may_complete_group_never_misses_a_completed_group(ops):
    c = Controller(400, group_size=GS)
    c.register_task("feeder", produces=["prompt_ids"])
    c.register_task("rollout", consumes=["prompt_ids"], produces=["response_ids"])
    c.register_task("reward", consumes=["response_ids"], produces=["reward"])
    c.register_task("advantage", consumes=COLS)
    next_group, reused, leases = 0, False, []
    for op, r in ops:
        g = torch.Generator().manual_seed(r)
        live = c._row_id[: c._n][c._alive[: c._n]]
        if op in ("put", "reuse"):
            groups = 1 + r % 5
            if c.num_live + groups * GS > c.capacity:
                continue
            if op == "reuse" and next_group:  # an old group id again, far from its first rows: the span fallback
                gids = torch.full((GS,), r % next_group, dtype=torch.int64)
                reused = True
            else:
                gids = torch.arange(next_group, next_group + groups).repeat_interleave(GS)
                next_group += groups
            ids = c.add_rows(gids.numel(), group_ids=gids)
            c.mark_ready(ids, ["prompt_ids", "response_ids"])
        elif op == "ready" and live.numel():
            written = live[torch.randperm(live.numel(), generator=g)[: 1 + r % 12]].sort().values
            c.mark_ready(written, ["reward"])
            expect = _complete_by_scan(c, "advantage", written, COLS, GS)
            got = c.may_complete_group(written, COLS, "advantage", GS)
            assert got or not expect, "a write completed a group and the gate said no: the lease would hang"
            if not reused:
                assert got == expect  # groups put together: the gate is exact
        elif op == "lease":
            meta = c.try_lease("advantage", COLS, GS * (1 + r % 3), sampler="group", partial=True)
            if meta is not None and len(meta):
                leases.append(meta.lease_id)
        elif op == "ack" and leases:
            lease_id = leases.pop(r % len(leases))
            try:
                c.ack(lease_id)
            except LeaseError as e:  # a drop took rows of this lease: the store cleared it, as documented
                assert "already cleared" in str(e), e
        elif op == "gc":
            c.gc()
        elif op == "drop" and live.numel():
            c.drop_rows(live[torch.randperm(live.numel(), generator=g)[: 1 + r % 10]])


def test_the_sampler_names_its_group_size():
    c = Controller(64, group_size=8)
    assert c.whole_group_size("group") == 8
    assert c.whole_group_size("fifo") == 0  # any write may satisfy a plain lease
    c_no_size = Controller(64)
    assert c_no_size.whole_group_size("group") == 0  # unknown: every write wakes it, the sampler then explains


def test_a_blocked_group_lease_returns_once_its_group_is_complete_and_not_before():
    async def main() -> None:
        store = InProcessStore(capacity=64, group_size=GS)
        await store.register_task("feeder", produces=["prompt_ids"])
        await store.register_task("reward", produces=["reward"])
        await store.register_task("advantage", consumes=["prompt_ids", "reward"])
        meta = await store.put({"prompt_ids": torch.arange(2 * GS)},
                               group_ids=torch.arange(2).repeat_interleave(GS))
        waiter = asyncio.ensure_future(store.get_meta("advantage", ["prompt_ids", "reward"], GS, sampler="group",
                                                      partial=True))
        for i in range(GS - 1):  # rows of group 0, one at a time, and every row of group 1 but one
            await store.put({"reward": torch.ones(2)}, rows=type(meta)(row_ids=meta.row_ids[[i, GS + i]]))
            for _ in range(5):
                await asyncio.sleep(0)
            assert not waiter.done()
        await store.put({"reward": torch.ones(1)}, rows=type(meta)(row_ids=meta.row_ids[[GS - 1]]))
        got = await asyncio.wait_for(waiter, 30)
        assert got.row_ids.tolist() == meta.row_ids[:GS].tolist()
        await store.close()

    asyncio.run(main())
