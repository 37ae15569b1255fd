"""Lengths-only simulation: zero-width ragged columns in the store, and the same schedule as full tokens.

The simulated rollout engine's ``payload: lengths`` returns token ids and
log-probs with no values (shape ``[tokens, 0]``); the store keeps such a
column as offsets only. A run must not notice: every decision of the
runtime (admission, staleness aborts, re-queues, the train batch) depends
on lengths and versions, never on token contents, so both payloads give the
very same schedule.
"""

from __future__ import annotations

import torch

from asyncflow_core.config.loader import resolve
from asyncflow_core.config.models import RunConfig
from asyncflow_core.flow.clock import run_virtual
from asyncflow_core.flow.runtime import FlowRuntime
from asyncflow_core.store.storage import StorageUnit
from asyncflow_core.types import RaggedTensor


def _lengths_only(lengths: list[int], dtype: torch.dtype = torch.int64) -> RaggedTensor:
    return RaggedTensor.from_lengths(torch.empty((sum(lengths), 0), dtype=dtype), torch.tensor(lengths))


# -------------------------------------------------------------------------------------- the store


def test_a_lengths_only_column_keeps_its_lengths_and_no_values():
    unit = StorageUnit()
    unit.write([0, 1, 2], {"ids": _lengths_only([5, 0, 7])})
    unit.write([3], {"ids": _lengths_only([4000])})
    out = unit.read([3, 0, 2, 1], ["ids"])["ids"]
    assert out.values.shape == (4000 + 5 + 7, 0)
    assert out.lengths.tolist() == [4000, 5, 7, 0]
    assert unit.schema["ids"].trailing == (0,)
    assert unit.lengths([0, 1, 2, 3], "ids").tolist() == [5, 0, 7, 4000]
    assert unit.allocated_nbytes == 0  # the arena holds offsets only


def test_failed_row_placeholders_fit_a_lengths_only_column_before_and_after_its_first_values():
    """Rows a stage failed on get empty 1-D placeholders; they must not fix or break a zero-width column."""
    unit = StorageUnit()
    empty = RaggedTensor.from_lengths(torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]))
    unit.write([0, 1], {"ids": empty})  # the column's first rows are placeholders
    unit.write([2, 3], {"ids": _lengths_only([3, 9])})  # then lengths-only values fix its trailing shape
    unit.write([4], {"ids": RaggedTensor.from_lengths(torch.empty(0, dtype=torch.int64), torch.tensor([0]))})
    assert unit.schema["ids"].trailing == (0,)
    assert unit.read([0, 2, 3, 4], ["ids"])["ids"].lengths.tolist() == [0, 3, 9, 0]


def test_a_column_with_values_still_refuses_another_trailing_shape():
    import pytest

    from asyncflow_core.store.errors import ColumnTypeError

    unit = StorageUnit()
    unit.write([0], {"ids": RaggedTensor.from_sequences([[1, 2, 3]])})
    with pytest.raises(ColumnTypeError, match="first written"):
        unit.write([1], {"ids": _lengths_only([4])})


def test_compaction_moves_long_and_short_rows_intact():
    """Freeing most rows compacts the arena (long rows move as slices, short ones by a gather); values survive."""
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(0, 3000, (60,), generator=gen)] + [1, 2, 3] * 10
    seqs = [torch.randint(0, 1 << 30, (n,), generator=gen) for n in lengths]
    unit = StorageUnit()
    for start in range(0, len(seqs), 7):  # several puts: several contiguous runs in the arena
        ids = list(range(start, min(start + 7, len(seqs))))
        unit.write(ids, {"ids": RaggedTensor.from_sequences([seqs[i] for i in ids]),
                         "w": _lengths_only([lengths[i] for i in ids])})
    drop = [i for i in range(len(seqs)) if i % 3]
    unit.free(drop)
    keep = [i for i in range(len(seqs)) if i % 3 == 0]
    unit.write([len(seqs)], {"ids": RaggedTensor.from_sequences([seqs[0]]), "w": _lengths_only([lengths[0]])})
    got = unit.read(keep, ["ids", "w"])
    for j, i in enumerate(keep):
        assert torch.equal(got["ids"][j], seqs[i])
    assert got["w"].lengths.tolist() == [lengths[i] for i in keep]


# ----------------------------------------------------------------------------- the same schedule


def _config(payload: str, *, mode: str = "one_step", k: int | None = None, policy: str = "requeue") -> RunConfig:
    async_cfg: dict = {"mode": mode, "stale_policy": policy}
    if k is not None:
        async_cfg["max_staleness"] = k
    return RunConfig.model_validate({
        "data": {"name": "sim", "options": {"size": 200, "prompt_tokens": 64}, "prompts_per_step": 6},
        "rollout": {"name": "sim", "replicas": 3, "n": 4, "max_new_tokens": 4096, "max_inflight": 16,
                    "rows_per_lease": 8,
                    # long tails (sigma 1.5): some responses outlive the bound and are aborted and re-queued
                    "options": {"payload": payload, "lengths": {"median_tokens": 200, "sigma": 1.5}}},
        "trainer": {"name": "sim", "options": {"latency": {"devices": 1}}, "total_steps": 5},
        "weight_transport": {"name": "sim"},
        "algorithm": {"name": "grpo", "options": {"group_size": 4}},
        "reward": {"name": "sim"},
        "async": async_cfg,
        "logging": {"level": "WARNING"},
    })


def _run(cfg: RunConfig) -> tuple[dict, FlowRuntime]:
    runtime = FlowRuntime(resolve(cfg), write_png=False)
    return run_virtual(runtime.run()), runtime


def _schedule(summary: dict) -> dict:
    """Everything a run decided and measured, less wall time."""
    return {k: v for k, v in summary.items() if k != "wall_seconds"}


def test_lengths_only_gives_the_schedule_and_accounting_of_full_tokens():
    full, rt_full = _run(_config("tokens"))
    short, rt_short = _run(_config("lengths"))
    assert full["steps"] == 5
    # the workload really exercises the bound: re-queues and rows trained one version late
    assert full["counters"].get("requeued_stale_rollout", 0) + full["ledger"].get("requeued", 0) > 0
    assert int(full["staleness_histogram"].get("1", 0)) > 0
    assert _schedule(short) == _schedule(full)  # step times, histogram, ledger, counters, utilisation: identical
    schema_full = rt_full.ctx.store.storage.schema
    schema_short = rt_short.ctx.store.storage.schema
    assert schema_full["response_ids"].trailing == () and schema_short["response_ids"].trailing == (0,)
    assert schema_short["behavior_logprobs"].trailing == (0,) and schema_short["response_versions"].trailing == (0,)


def test_lengths_only_matches_full_tokens_when_stale_rows_are_dropped_and_under_a_larger_bound():
    for cfg in (lambda p: _config(p, policy="drop"), lambda p: _config(p, mode="async", k=2)):
        full, _ = _run(cfg("tokens"))
        short, _ = _run(cfg("lengths"))
        assert full["steps"] == 5
        assert _schedule(short) == _schedule(full)
