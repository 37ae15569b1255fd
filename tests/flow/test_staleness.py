"""The admission formula and the staleness rule, as pure functions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_core.flow import staleness as S


def test_admission_limit_is_k_plus_v_plus_one_steps_of_prompts():
    assert S.admission_limit(0, 0, 8) == 8  # sync: one step's prompts before the first update
    assert S.admission_limit(0, 1, 8) == 16  # one_step: the next step's prompts start early
    assert S.admission_limit(3, 2, 5) == 30
    with pytest.raises(ValueError):
        S.admission_limit(0, -1, 8)
    with pytest.raises(ValueError):
        S.admission_limit(0, 0, 0)


@given(v=st.integers(0, 1000), k=st.integers(0, 8), minv=st.integers(0, 1000))
def test_the_rule_and_its_helpers_agree(v, k, minv):
    fresh = S.is_fresh(v, minv, k)
    assert fresh == (v - minv <= k)
    assert S.must_abort(minv, v, k) == (minv < S.oldest_usable(v, k))
    # a row that may be used now is never aborted now, and vice versa (for rows not from the future)
    if minv <= v:
        assert fresh != S.must_abort(minv, v, k)
    assert S.engine_may_start(minv, v, k) == (not S.must_abort(minv, v, k))


@given(
    v=st.integers(0, 50), k=st.integers(0, 4),
    rows=st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 50)), min_size=1, max_size=40),
)
def test_groups_are_fresh_or_stale_as_a_whole(v, k, rows):
    gids = torch.tensor([g for g, _ in rows])
    minv = torch.tensor([m for _, m in rows])
    fresh, stale = S.split_fresh_groups(v, k, gids, minv)
    assert bool((fresh ^ stale).all())  # a partition
    assert bool(((v - minv[fresh]) <= k).all())  # no fresh row breaks the bound
    for g in set(gids.tolist()) - {-1}:
        members = gids == g
        assert bool(fresh[members].all()) or bool(stale[members].all())
    ungrouped = gids < 0
    assert bool((stale[ungrouped] == ((v - minv[ungrouped]) > k)).all())


# -- the trainer's check of the bound, on episodes ---------------------------------------------------------------
#
# Two episodes go through the real TrajectoryWriter into a real store and then to the real TrainStage at trainer
# version 2 with k = 1 (B = 1 group of 1 row per step): episode 0's first turn was sampled at version 0 and its
# last at 2 (lag 2 over its sampled tokens: stale), episode 1's turns at 1 and 2 (lag 1: fresh). The row's
# version range, which the writer puts beside it, must be taken over every sampled token of every turn.

import asyncio  # noqa: E402
import inspect  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.flow import trajectory_writer as TW  # noqa: E402
from asyncflow_core.flow.ledger import Ledger  # noqa: E402
from asyncflow_core.flow.stage import FlowContext  # noqa: E402
from asyncflow_core.flow.telemetry import Timeline  # noqa: E402
from asyncflow_core.flow.train_stage import TrainStage  # noqa: E402
from asyncflow_core.interfaces.store import BatchMeta  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.store.inprocess import InProcessStore  # noqa: E402
from asyncflow_core.types import PromptRecord, RaggedTensor  # noqa: E402
from asyncflow_core.types.episode import Segment, Trajectory  # noqa: E402

#: (first turn's versions, last turn's versions) of each episode row; the trainer is at version 2, k = 1
EPISODES = [((0, 0), (2, 2)), ((1, 1), (2, 2))]
TRAINER_V, K = 2, 1
#: the writer's version range, taken with max instead of min (the mutant the tests below must catch)
MIN_LINE = "lo = min(seg.versions) if lo is None else min(lo, min(seg.versions))"
MAX_LINE = "lo = max(seg.versions) if lo is None else max(lo, max(seg.versions))"


class _Trainer:
    """A train engine that records what it trained on (the row's response tokens) and counts versions."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.trained: list[list[int]] = []

    async def train_step(self, batch, algorithm):
        self.trained += [batch[C.RESPONSE_IDS][i].tolist() for i in range(batch.num_rows)]
        self.version += 1
        return {"loss": 0.0}

    async def export_weights(self, *, bucket_bytes):
        return
        yield


class _Transport:
    async def send(self, buckets, *, deadline_s):
        async for _ in buckets:
            pass
        return SimpleNamespace(version=TRAINER_V + 1)


def _trajectory(first: tuple[int, ...], last: tuple[int, ...], tag: int) -> Trajectory:
    segs = [Segment((tag, 1), sampled=True, logprobs=(-0.5, -0.5), versions=first, turn=0),
            Segment((3, 3), sampled=False, turn=0),
            Segment((tag, 2), sampled=True, logprobs=(-0.5, -0.5), versions=last, turn=1)]
    return Trajectory(prompt_ids=(), segments=segs, turn_rewards=[0.0, 1.0], reward=1.0)


async def _train_on_episodes(*, settle_staleness: bool = True):
    """Write :data:`EPISODES` and run one train step at version 2 (k = 1); returns (trainer, ctx, error or None).

    ``settle_staleness`` False: the stage's settling keeps every row (a settle that forgot the bound), so only
    the stage's own assertion stands between a stale row and the trainer."""
    store = InProcessStore(capacity=64, group_size=1)
    ctx = FlowContext(store=store, timeline=Timeline(time.monotonic), ledger=Ledger(), k=K, prompts_per_step=1,
                      n=1, clock=time.monotonic)
    ctx.version = TRAINER_V
    columns = TW.ROLLOUT_OUT + C.EPISODE_COLUMNS + (C.REWARD,)
    await store.register_task("feeder", produces=(C.PROMPT_IDS, C.GROUP_ID))
    await store.register_task("rollout", consumes=(C.PROMPT_IDS, C.GROUP_ID), produces=columns)
    await store.register_task("advantage", consumes=columns, produces=(C.ADVANTAGES,))
    algo = get_plugin_manager().create("algorithm", "grpo", {"group_size": 1})
    trainer = _Trainer(TRAINER_V)
    stage = TrainStage(trainer, algo, _Transport(), None, consumes=(*columns, C.ADVANTAGES),
                       total_steps=TRAINER_V + 1, bucket_bytes=1 << 20, deadline_s=5.0, colocated=False)
    await store.register_task("train", consumes=stage.consumes)
    stage.bind(ctx)
    if not settle_staleness:
        stage._settle = lambda v, meta, batch: torch.arange(batch.num_rows)  # type: ignore[method-assign]
    gids = [ctx.ledger.admit(i, PromptRecord(i, "p")).group_id for i in range(len(EPISODES))]
    await store.put({C.PROMPT_IDS: RaggedTensor.from_sequences([[1, 2]] * len(EPISODES)),
                     C.GROUP_ID: torch.tensor(gids)}, group_ids=torch.tensor(gids))
    lease = await store.get_meta("rollout", (C.PROMPT_IDS, C.GROUP_ID), len(EPISODES), partial=True)
    writer = TW.TrajectoryWriter("rollout", interval_s=60.0, spawn=lambda c: c.close(), on_written=lambda: None,
                                 columns=columns)
    writer.ctx = ctx
    held = SimpleNamespace(meta=lease, remaining=len(EPISODES))
    for row, (first, last) in zip(lease.row_ids.tolist(), EPISODES, strict=True):
        await writer.write(SimpleNamespace(row=row, lease=held, prompt=(1, 2)), _trajectory(first, last, 4 + row))
    await writer.flush()
    adv = await store.get_meta("advantage", columns, len(EPISODES), partial=True)
    rows = await store.get(adv)
    await store.put({C.ADVANTAGES: RaggedTensor(torch.ones(rows[C.RESPONSE_IDS].numel_packed),
                                                rows[C.RESPONSE_IDS].offsets)}, rows=BatchMeta(row_ids=adv.row_ids))
    await store.ack(adv)
    try:
        await asyncio.wait_for(stage.run(), 30)
    except AssertionError as exc:
        return trainer, ctx, exc
    return trainer, ctx, None


def test_a_stale_first_turn_makes_the_episode_stale_though_its_last_turn_is_fresh():
    """The trainer never trains on the episode whose first turn is outside the bound: its group is re-queued
    (stale_policy requeue) and the step trains on the fresh episode."""
    trainer, ctx, error = asyncio.run(_train_on_episodes())
    assert error is None and ctx.stop_reason == "done"
    assert trainer.trained == [[5, 1, 3, 3, 5, 2]], "the step should train on the fresh episode (row 1) only"
    assert ctx.ledger.counters["requeued_stale"] == 1
    assert ctx.ledger.summary()["trained"] == 1


def test_the_trainer_asserts_the_bound_on_an_episode_that_slips_past_settling():
    """With the stage's settling blind to staleness, its assertion on the rows it is about to train fires on the
    episode row: lag 2 (trainer 2, oldest sampled token 0, in the first turn) > k = 1; nothing is trained."""
    trainer, ctx, error = asyncio.run(_train_on_episodes(settle_staleness=False))
    assert error is not None and f"staleness violated: lag 2 > k={K} at step {TRAINER_V}" in str(error)
    assert trainer.trained == []


def _mutated_writer(monkeypatch) -> None:
    """Replace TrajectoryWriter._episode_columns by its own source with the row's oldest version taken as max."""
    source = textwrap.dedent(inspect.getsource(TW.TrajectoryWriter._episode_columns))
    assert source.count(MIN_LINE) == 1, "the writer's version range changed: update MIN_LINE to the new code"
    namespace: dict = {}
    exec(compile(source.replace(MIN_LINE, MAX_LINE), TW.__file__, "exec"), vars(TW), namespace)  # noqa: S102
    monkeypatch.setattr(TW.TrajectoryWriter, "_episode_columns", namespace["_episode_columns"])


def test_a_writer_taking_the_newest_turn_for_the_version_range_is_caught(monkeypatch):
    """The mutant writer (max instead of min over the sampled turns) dates the stale episode at version 2: the
    trainer then takes it (the first test's check fails) and the assertion stays silent (the second's fails)."""
    _mutated_writer(monkeypatch)
    trainer, ctx, error = asyncio.run(_train_on_episodes())
    assert error is None and trainer.trained == [[4, 1, 3, 3, 4, 2]], trainer.trained  # the stale episode, trained
    assert ctx.ledger.counters["requeued_stale"] == 0
    trainer, _, error = asyncio.run(_train_on_episodes(settle_staleness=False))
    assert error is None and trainer.trained == [[4, 1, 3, 3, 4, 2]]


class _PutStore:
    """Keeps what the writer puts: the columns and the rows' version ranges."""

    def __init__(self) -> None:
        self.versions: torch.Tensor | None = None

    async def put(self, cols, *, rows, versions):
        self.versions = versions

    async def ack(self, meta):
        pass


def _written_range(turns: list[list[int]]) -> tuple[int, int]:
    """The version range the writer puts for one episode whose sampled turns have ``turns``' versions."""
    segs = []
    for t, versions in enumerate(turns):
        segs.append(Segment(tuple(range(len(versions))), sampled=True, logprobs=(-0.1,) * len(versions),
                            versions=tuple(versions), turn=t))
        segs.append(Segment((7,), sampled=False, turn=t))
    store = _PutStore()
    writer = TW.TrajectoryWriter("rollout", interval_s=60.0, spawn=lambda c: c.close(), on_written=lambda: None,
                                 columns=TW.ROLLOUT_OUT + C.EPISODE_COLUMNS)
    writer.ctx = SimpleNamespace(store=store, version=99, processed=Counter(), counters=Counter())

    async def write():
        await writer.write(SimpleNamespace(row=0, lease=SimpleNamespace(meta=None, remaining=1)),
                           Trajectory(prompt_ids=(), segments=segs, turn_rewards=[0.0] * len(turns)))
        await writer.flush()

    asyncio.run(write())
    assert store.versions is not None
    lo, hi = store.versions[0].tolist()
    return lo, hi


@given(st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=4), min_size=1, max_size=5))
def test_the_written_version_range_spans_every_sampled_token_of_every_turn(turns):
    """The row's range (what the store's ``min_version`` and so the trainer's lag come from) is the oldest and
    newest sampled token over all turns, in whatever order the versions came (observed tokens add none)."""
    assert _written_range(turns) == (min(min(t) for t in turns), max(max(t) for t in turns))


def test_the_property_fails_on_the_max_mutant(monkeypatch):
    _mutated_writer(monkeypatch)
    assert _written_range([[0, 1], [2]]) == (2, 2)  # the mutant dates the episode by its newest turn
