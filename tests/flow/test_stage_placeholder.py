"""``Stage.placeholder``: failed rows get zeros in each produced column's own kind and dtype.

It once wrote every column float32, and ragged whenever the batch held
``response_ids``: a plugin's dense column then could not be joined with the
rows that succeeded, and one failing row stopped the loop.
"""

from __future__ import annotations

import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.stage import STANDARD_COLUMN_TYPES, Stage, StageOutput
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_spec.base import run
from asyncflow_spec.stage import StageSpec


class Mixed(Stage):
    """Produces a standard dense, a standard per-token ragged, and two columns of its own; fails on one row."""

    name = "mixed"
    consumes = (C.RESPONSE_IDS,)
    produces = (C.GROUP_ID, C.REF_LOGPROBS, "n_calls", "score")
    column_types = {"n_calls": ("dense", torch.int64)}  # "score" is left to the default: dense float32
    poisoned: int | None = None

    async def process(self, batch: Batch) -> StageOutput:
        if self.poisoned is not None and self.poisoned in batch.row_ids.tolist():
            raise RuntimeError("injected")
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        return StageOutput({
            C.GROUP_ID: torch.arange(batch.num_rows, dtype=torch.int64) + 100,
            C.REF_LOGPROBS: RaggedTensor(-torch.ones(resp.numel_packed), resp.offsets),
            "n_calls": resp.lengths.to(torch.int64),
            "score": resp.lengths.float() / 2,
        })


def test_placeholder_kinds_and_dtypes_per_column():
    batch = StageSpec().make_batch(6)
    out = Mixed().placeholder(batch)
    resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
    assert out[C.GROUP_ID].dtype == torch.int64 and out[C.GROUP_ID].shape == (6,)
    ref = out[C.REF_LOGPROBS]
    assert isinstance(ref, RaggedTensor) and ref.dtype == torch.float32
    assert torch.equal(ref.offsets, resp.offsets) and not ref.values.any()  # one zero per response token
    assert out["n_calls"].dtype == torch.int64 and out["n_calls"].shape == (6,)
    assert out["score"].dtype == torch.float32 and out["score"].shape == (6,)


def test_a_ragged_column_without_response_ids_gets_empty_sequences():
    class Own(Stage):
        produces = ("spans",)
        column_types = {"spans": ("ragged", torch.int64)}

    (spans,) = Own().placeholder(Batch({C.GROUP_ID: torch.zeros(3, dtype=torch.int64)})).values()
    assert isinstance(spans, RaggedTensor) and spans.dtype == torch.int64 and spans.lengths.tolist() == [0, 0, 0]


def test_the_standard_table_covers_every_standard_column():
    # every upper-case string in columns.py is a column name, except a prefix for a family of columns
    names = {v for k, v in vars(C).items() if k.isupper() and isinstance(v, str) and not k.endswith("_PREFIX")}
    assert names <= STANDARD_COLUMN_TYPES.keys(), names - STANDARD_COLUMN_TYPES.keys()


def test_one_failing_row_in_the_loop_keeps_every_columns_kind_and_the_other_rows():
    spec = StageSpec()
    batch = spec.make_batch(spec.rows)
    stage = Mixed()
    ctx, written = run(spec.through_the_loop(stage, batch, lambda ids: setattr(stage, "poisoned", ids[3])))
    assert ctx.counters["failed_mixed"] == 1 and ctx.outcomes.reasons[stage.poisoned].detail.endswith("injected")
    resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
    assert written["n_calls"].dtype == torch.int64
    assert written["n_calls"].tolist() == [0 if i == 3 else int(n) for i, n in enumerate(resp.lengths)]
    assert written["score"].dtype == torch.float32 and written[C.GROUP_ID].dtype == torch.int64
    ref = written[C.REF_LOGPROBS]
    assert isinstance(ref, RaggedTensor) and torch.equal(ref.lengths, resp.lengths)
    assert [float(ref[i].sum()) == 0 for i in range(spec.rows)] == [i == 3 for i in range(spec.rows)]
