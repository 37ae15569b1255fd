"""TrajectoryWriter on its own: columns per row, placeholders, batching and acks once a lease is written.

Uses a fake store that records puts and acks (no runtime or engine).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.trajectory_writer import ROLLOUT_OUT, TrajectoryWriter
from asyncflow_core.types import FinishReason, GenerationResult


class FakeStore:
    def __init__(self) -> None:
        self.puts: list[tuple] = []
        self.acks: list = []

    async def put(self, cols, *, rows, versions):
        self.puts.append((cols, rows.row_ids.tolist(), versions.tolist()))

    async def ack(self, meta):
        self.acks.append(meta)


def _res(rid, n, reason=FinishReason.STOP, v=(1, 2)):
    return GenerationResult(request_id=rid, prompt_token_ids=(1,), token_ids=list(range(n)), logprobs=[-0.5] * n,
                            versions=[v[0]] * (n - 1) + [v[1]], finish_reason=reason)


def test_rows_are_written_as_the_rollout_columns_and_a_lease_is_acked_once_whole():
    store = FakeStore()
    ctx = SimpleNamespace(store=store, version=3, processed=Counter(), counters=Counter())
    written = []
    w = TrajectoryWriter("rollout", interval_s=10.0, spawn=lambda coro: asyncio.ensure_future(coro),
                         on_written=lambda: written.append(1))
    w.ctx = ctx
    lease_a = SimpleNamespace(meta="A", remaining=2)
    lease_b = SimpleNamespace(meta="B", remaining=2)

    async def main():
        await w.write(SimpleNamespace(row=7, lease=lease_a), _res("r7", 3))
        await w.write(SimpleNamespace(row=8, lease=lease_a), None)  # settled without a result
        await w.write(SimpleNamespace(row=9, lease=lease_b), _res("r9", 2, FinishReason.LENGTH))
        assert store.puts == []  # buffered until the interval or 64 rows
        await w.flush()

    asyncio.run(main())
    (cols, rows, vrange), = store.puts
    assert set(cols) == set(ROLLOUT_OUT) and rows == [7, 8, 9]
    assert cols[C.RESPONSE_IDS].lengths.tolist() == [3, 0, 2]
    assert cols[C.RESPONSE_VERSIONS].values.tolist() == [1, 1, 2, 1, 2]
    assert cols[C.TRUNCATED].tolist() == [False, False, True]
    assert vrange == [[1, 2], [3, 3], [1, 2]]  # a placeholder row gets the current version
    assert store.acks == ["A"] and lease_b.remaining == 1 and written == [1]
    assert ctx.processed["rollout"] == 3 and ctx.counters["tokens_generated"] == 5


def _timed_writer() -> tuple[TrajectoryWriter, FakeStore]:
    """A writer whose timer (10 s) never fires within a test: any put comes from an end-of-turn flush."""
    store = FakeStore()
    w = TrajectoryWriter("rollout", interval_s=10.0, spawn=lambda coro: asyncio.ensure_future(coro),
                         on_written=lambda: None)
    w.ctx = SimpleNamespace(store=store, version=0, processed=Counter(), counters=Counter())
    return w, store


def test_64_rows_flush_at_the_end_of_the_turn_with_the_rest_of_the_burst():
    w, store = _timed_writer()
    lease = SimpleNamespace(meta="L", remaining=300)  # 200 rows still out: only the 64-row rule can flush

    async def main():
        for i in range(100):  # one engine burst: written in one event-loop turn
            await w.write(SimpleNamespace(row=i, lease=lease), _res(f"r{i}", 1, v=(0, 0)))
        assert store.puts == []  # 64 rows wait: the flush runs once this turn ends, with the whole burst
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())  # well before the 10 s interval
    assert len(store.puts) == 1 and store.acks == [] and lease.remaining == 200
    assert torch.equal(torch.tensor(store.puts[0][1]), torch.arange(100))


def test_a_leases_last_row_is_put_at_the_end_of_the_turn_not_after_the_timer():
    """A lease whose every row is written waits for no timer (in a sync step its groups are the step); a lease
    with rows still out waits for the interval as before."""
    w, store = _timed_writer()
    whole = SimpleNamespace(meta="W", remaining=3)
    open_ = SimpleNamespace(meta="O", remaining=5)

    async def main():
        await w.write(SimpleNamespace(row=0, lease=open_), _res("o0", 1, v=(0, 0)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert store.puts == []  # 4 of the open lease's rows are still out: the 10 s timer holds the row
        for i in range(3):
            await w.write(SimpleNamespace(row=10 + i, lease=whole), _res(f"w{i}", 1, v=(0, 0)))
        assert store.puts == []  # at the end of this turn, not inside it
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())  # well before the 10 s interval
    assert len(store.puts) == 1 and store.puts[0][1] == [0, 10, 11, 12] and store.acks == ["W"]
    assert open_.remaining == 4 and whole.remaining == 0


def test_episodes_are_written_with_mask_turns_carried_versions_and_per_episode_columns():
    from asyncflow_core.types.episode import Segment, Trajectory

    store = FakeStore()
    ctx = SimpleNamespace(store=store, version=5, processed=Counter(), counters=Counter())
    cols_out = ROLLOUT_OUT + C.EPISODE_COLUMNS + (C.REWARD,)
    w = TrajectoryWriter("rollout", interval_s=10.0, spawn=lambda coro: asyncio.ensure_future(coro),
                         on_written=lambda: None, columns=cols_out)
    w.ctx = ctx
    lease = SimpleNamespace(meta="L", remaining=2)
    traj = Trajectory(prompt_ids=(1, 2), segments=[
        Segment((10, 11), sampled=True, logprobs=(-0.5, -0.25), versions=(3, 4), turn=0),
        Segment((20, 21, 22), sampled=False, turn=0),
        Segment((12,), sampled=True, logprobs=(-1.0,), versions=(5,), turn=1),
    ], turn_rewards=[0.5, 1.0], reward=1.5, info={"tool_calls": 2, "tool_ok": 1, "env_s": 0.25, "truncated": False})

    async def main():
        await w.write(SimpleNamespace(row=3, lease=lease), traj)
        await w.write(SimpleNamespace(row=4, lease=lease), None)  # a failed episode: placeholder
        await w.flush()

    asyncio.run(main())
    (cols, rows, vrange), = store.puts
    assert tuple(cols) == cols_out and rows == [3, 4]
    assert cols[C.RESPONSE_IDS].lengths.tolist() == [6, 0]
    assert cols[C.RESPONSE_IDS].values.tolist() == [10, 11, 20, 21, 22, 12]
    assert cols[C.LOSS_MASK].values.tolist() == [True, True, False, False, False, True]
    assert cols[C.BEHAVIOR_LOGPROBS].values.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    # observed tokens carry the version of the last sampled token before them: the row's min is the sampled min
    assert cols[C.RESPONSE_VERSIONS].values.tolist() == [3, 4, 4, 4, 4, 5]
    assert cols[C.TURN_IDS].values.tolist() == [0, 0, 0, 0, 0, 1]
    assert cols[C.TURN_REWARDS].lengths.tolist() == [2, 0] and cols[C.TURN_REWARDS].values.tolist() == [0.5, 1.0]
    assert cols[C.REWARD].tolist() == [1.5, 0.0]
    assert cols[C.EPISODE_TURNS].tolist() == [2, 0] and cols[C.EPISODE_TOOL_CALLS].tolist() == [2, 0]
    assert cols[C.EPISODE_TOOL_OK].tolist() == [1, 0] and cols[C.EPISODE_ENV_S].tolist() == [0.25, 0.0]
    assert cols[C.EPISODE_MASKED_FRAC].tolist() == [0.5, 0.0]
    assert vrange == [[3, 5], [5, 5]]
    assert ctx.counters["tokens_generated"] == 3  # sampled tokens only
    for name, col in cols.items():  # every column in the kind and dtype the standard table gives
        kind, dtype = C.STANDARD_COLUMN_TYPES[name]
        assert col.dtype == dtype and (kind == "dense") == isinstance(col, torch.Tensor), name
    assert store.acks == ["L"]


def _flushed(results):
    """The columns one flush puts for ``results`` (rows 0..n-1, one lease)."""
    store = FakeStore()
    w = TrajectoryWriter("rollout", interval_s=10.0, spawn=lambda coro: asyncio.ensure_future(coro),
                         on_written=lambda: None)
    w.ctx = SimpleNamespace(store=store, version=5, processed=Counter(), counters=Counter())
    lease = SimpleNamespace(meta="L", remaining=len(results))

    async def main():
        for i, res in enumerate(results):
            await w.write(SimpleNamespace(row=i, lease=lease), res)
        await w.flush()

    asyncio.run(main())
    (cols, _, vrange), = store.puts
    return cols, vrange


def test_results_of_lists_and_of_tensors_pack_to_the_same_columns():
    """The list path (one tensor per column for the whole write) and the per-row tensor path agree exactly."""
    lists = [_res("a", 3), None, _res("b", 1, FinishReason.LENGTH), _res("c", 2, v=(4, 4))]
    tensors = [None if r is None else GenerationResult(
        request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=torch.tensor(r.token_ids),
        logprobs=torch.tensor(r.logprobs), versions=torch.tensor(r.versions), finish_reason=r.finish_reason)
        for r in lists]
    mixed = [lists[0], None, tensors[2], lists[3]]  # one tensor result sends the whole write down the tensor path
    (a, va), (b, vb), (c, vc) = _flushed(lists), _flushed(tensors), _flushed(mixed)
    for cols in (b, c):
        for name in (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.RESPONSE_VERSIONS):
            assert cols[name].values.dtype == a[name].values.dtype
            assert torch.equal(cols[name].values, a[name].values) and torch.equal(cols[name].offsets, a[name].offsets)
        assert torch.equal(cols[C.TRUNCATED], a[C.TRUNCATED])
    assert va == vb == vc == [[1, 2], [5, 5], [2, 2], [4, 4]]
    assert a[C.BEHAVIOR_LOGPROBS].values.dtype == torch.float32 and a[C.RESPONSE_IDS].values.dtype == torch.int64
