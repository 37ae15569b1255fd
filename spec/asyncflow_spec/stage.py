"""Conformance tests for flow stage plugins (``asyncflow_stages``: ``pipeline.stages`` / ``pipeline.replace``).

A stage declares the columns it ``consumes`` and ``produces`` and computes
them in ``process``; the runtime's loop (``Stage.run``) leases rows from the
store, writes the outputs, records failed rows and turns ``drop`` into a
filtered prompt group. The suite checks the stage's side of that contract
on its own and inside the real loop over the in-process store:

- it reads only the columns it consumes and writes exactly the ones it
  produces, one value (dense) or one sequence (ragged) per row, in the
  declared dtype (the standard columns' dtypes are those of
  ``asyncflow_core.columns``; a stage's own columns are declared on the
  spec class in ``column_dtypes``);
- a ``drop`` marks exactly the dropped rows filtered (their prompt groups
  are then dropped by the trainer), counted under ``filtered_<stage>``;
- a row it fails on is recorded with the error, gets placeholder outputs in
  the declared dtypes, and the other rows are still processed.

Test batches hold the standard columns the suite can make (prompt and
response ids, behaviour log-probs, versions, reward, group ids, truncated);
override :meth:`StageSpec.make_batch` for a stage that consumes others, or to
include rows the stage drops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.errors import StoreError
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.outcomes import RowOutcome
from asyncflow_core.flow.stage import PER_RESPONSE_TOKEN as CORE_PER_RESPONSE_TOKEN
from asyncflow_core.flow.stage import STANDARD_COLUMN_TYPES, FlowContext, Stage, StageOutput
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_spec.base import BackendSpec, run

#: The standard columns' kind and dtype, and those with one value per response token: the runtime's own tables
#: (asyncflow_core/flow/stage.py), so the suite checks a stage against exactly what the loop writes.
STANDARD_COLUMNS = STANDARD_COLUMN_TYPES
PER_RESPONSE_TOKEN = CORE_PER_RESPONSE_TOKEN


class StageSpec(BackendSpec):
    """Subclass and set ``backend`` (the registered stage name) and ``options``.

    ``column_dtypes`` declares the dtype of each column the stage produces
    that is not a standard one (e.g. ``{"too_long": torch.float32}``).
    """

    kind = PluginKind.STAGE
    rows: ClassVar[int] = 8
    group_size: ClassVar[int] = 2
    vocab_size: ClassVar[int] = 16
    column_dtypes: ClassVar[dict[str, torch.dtype]] = {}

    # -- what the suite feeds the stage ------------------------------------------------------------------

    def make_batch(self, rows: int) -> Batch:
        """Rows in groups of ``group_size``; response ``i``: ``1 + i mod 4`` tokens from ``3 i mod vocab`` on."""
        prompts = [torch.tensor([1 + i % (self.vocab_size - 1), 2], dtype=torch.int64) for i in range(rows)]
        responses = [torch.tensor([(3 * i + j) % self.vocab_size for j in range(1 + i % 4)], dtype=torch.int64)
                     for i in range(rows)]
        resp = RaggedTensor.from_sequences(responses, dtype=torch.int64)
        lengths = resp.lengths
        columns = {
            C.PROMPT_IDS: RaggedTensor.from_sequences(prompts, dtype=torch.int64),
            C.RESPONSE_IDS: resp,
            C.BEHAVIOR_LOGPROBS: RaggedTensor(-torch.linspace(0.1, 2.0, int(lengths.sum())), resp.offsets),
            C.RESPONSE_VERSIONS: RaggedTensor(torch.zeros(int(lengths.sum()), dtype=torch.int64), resp.offsets),
            C.REWARD: (torch.arange(rows) % 3).to(torch.float32) / 2,
            C.GROUP_ID: torch.arange(rows, dtype=torch.int64) // self.group_size,
            C.TRUNCATED: lengths == 4,
        }
        return Batch(columns)

    def declared(self, column: str) -> tuple[str | None, torch.dtype]:
        """``(kind, dtype)`` of a produced column: ``column_dtypes`` first, then the standard table."""
        if column in self.column_dtypes:
            return None, self.column_dtypes[column]
        if column in STANDARD_COLUMNS:
            return STANDARD_COLUMNS[column]
        pytest.fail(f"the stage produces {column!r}, which is no standard column: declare its dtype in the spec "
                    f"class's column_dtypes")

    def inputs(self, stage: Stage) -> Batch:
        batch = self.make_batch(self.rows)
        missing = [c for c in stage.consumes if c not in batch.columns]
        if missing:
            pytest.fail(f"the stage consumes {missing}, which the suite's batch lacks: override make_batch() to "
                        "provide them")
        return batch.project(list(stage.consumes))

    def build(self, make_backend: Any) -> Stage:
        stage = make_backend()
        assert isinstance(stage, Stage), f"the factory must return a Stage, got {type(stage).__name__}"
        return stage

    def check_columns(self, stage: Stage, batch: Batch, columns: dict[str, Any], where: str) -> None:
        """Exactly the produced columns, one entry per row, in the declared kind and dtype."""
        assert set(columns) == set(stage.produces), (
            f"{where}: wrote {sorted(columns)}, but the stage declares produces={list(stage.produces)}"
        )
        for name, value in columns.items():
            kind, dtype = self.declared(name)
            if isinstance(value, RaggedTensor):
                assert kind in (None, "ragged"), f"{where}: {name} must be a dense column, got a RaggedTensor"
                assert value.num_rows == batch.num_rows, f"{where}: {name} has {value.num_rows} rows"
                if name in PER_RESPONSE_TOKEN and C.RESPONSE_IDS in batch.columns:
                    assert torch.equal(value.offsets, batch[C.RESPONSE_IDS].offsets), (
                        f"{where}: {name} holds one value per response token; its offsets must be response_ids'"
                    )
                got = value.values.dtype
            else:
                assert isinstance(value, torch.Tensor), f"{where}: {name} is a {type(value).__name__}, not a tensor"
                assert kind in (None, "dense"), f"{where}: {name} must be ragged (one sequence per row)"
                assert value.shape[:1] == (batch.num_rows,), f"{where}: {name} has shape {tuple(value.shape)}"
                got = value.dtype
            assert got == dtype, f"{where}: {name} is {got}, declared {dtype}"

    def context(self, store: Any) -> FlowContext:
        loop = asyncio.get_running_loop()
        return FlowContext(store=store, timeline=Timeline(loop.time), ledger=Ledger(), k=1,
                           prompts_per_step=self.rows // self.group_size, n=self.group_size, clock=loop.time)

    async def through_the_loop(self, stage: Stage, batch: Batch,
                               on_put: Callable[[list[int]], None] | None = None) -> tuple[FlowContext, Batch]:
        """Run ``stage`` in the runtime's loop over an in-process store holding ``batch``; returns what it wrote.

        ``on_put`` is called with the store's row id of each batch row (in
        batch order) before the stage runs. The written batch is in batch order.
        """
        store = get_plugin_manager().create(PluginKind.STORE, "inprocess", {"capacity": 4 * self.rows})
        try:
            ctx = self.context(store)
            await store.register_task("source", produces=list(batch.columns))
            stage.bind(ctx)
            await store.register_task(stage.name, consumes=stage.consumes, produces=stage.produces)
            await store.register_task("check", consumes=list(stage.produces))
            groups = (batch[C.GROUP_ID] if C.GROUP_ID in batch.columns
                      else torch.arange(batch.num_rows) // self.group_size)
            put = await store.put({n: batch[n] for n in batch.columns}, group_ids=groups)
            ids = put.row_ids.tolist()
            if on_put is not None:
                on_put(ids)
            await store.end_stream()
            await stage.setup()
            try:
                await stage.run()
            except Exception as exc:  # noqa: BLE001 - the loop must survive failing rows; say what broke it
                pytest.fail(f"the runtime's loop over this stage raised {type(exc).__name__}: {exc} (outputs for "
                            "failed rows come from placeholder(): return each produced column in its own kind and "
                            "dtype)")
            try:
                # the loop has ended: every write is in; a column still missing was never written
                meta = await store.get_meta("check", list(stage.produces), batch.num_rows, partial=True, timeout=5)
            except StoreError as exc:
                pytest.fail(f"the loop did not write every produced column {list(stage.produces)}: {exc}")
            written = await store.get(meta)
            position = {row: i for i, row in enumerate(written.row_ids.tolist())}
            assert sorted(position) == sorted(ids), "the loop did not write every row the stage leased"
            return ctx, written.select(torch.tensor([position[row] for row in ids]))
        finally:
            await store.close()

    # -- the tests -----------------------------------------------------------------------------------------

    def test_declares_its_columns(self, make_backend):
        """``name``, ``consumes`` and ``produces`` are set: a name, column names, at least one produced column.

        Fix: set them as class attributes of your Stage (``produces`` is what
        the runtime waits for downstream; a column only a later stage reads
        must still be declared here).
        """
        stage = self.build(make_backend)
        assert isinstance(stage.name, str) and stage.name and stage.name != "stage", "give the stage its own name"
        assert all(isinstance(c, str) and c for c in (*stage.consumes, *stage.produces))
        assert stage.produces, "a stage must produce at least one column"
        for column in stage.produces:
            self.declared(column)

    def test_process_writes_exactly_what_it_declares_from_only_what_it_consumes(self, make_backend):
        """Given only its consumed columns, ``process`` returns every produced column for every row, dtypes as declared.

        The same rows with every other column present give the same outputs:
        the stage reads nothing it does not declare. Fix: read only
        ``consumes``, return every column of ``produces``, in the dtype the
        column is declared with.
        """
        stage = self.build(make_backend)
        batch = self.inputs(stage)

        async def body():
            await stage.setup()
            try:
                only = await stage.process(batch)
            except KeyError as exc:
                pytest.fail(f"process() read column {exc} but the stage does not declare it in consumes "
                            f"{list(stage.consumes)}")
            full = await stage.process(self.make_batch(self.rows))
            return only, full

        only, full = run(body())
        assert isinstance(only, StageOutput), f"process must return a StageOutput, got {type(only).__name__}"
        self.check_columns(stage, batch, dict(only.columns), "process")
        for name in stage.produces:
            assert _same(only.columns[name], full.columns[name]), (
                f"{name} changed when columns the stage does not consume were present"
            )
        if only.drop is not None:
            assert only.drop.shape == (batch.num_rows,), f"drop needs one entry per row, got {tuple(only.drop.shape)}"
            assert only.drop.dtype == torch.bool or bool(((only.drop == 0) | (only.drop == 1)).all())
        if only.versions is not None:
            assert only.versions.shape == (batch.num_rows, 2) and only.versions.dtype == torch.int64

    def test_runs_in_the_flow_loop_and_writes_every_row(self, make_backend):
        """In the runtime's loop over the store, every row gets the produced columns, dtypes as declared.

        Fix: a stage that overrides ``run`` or ``handle`` must still write
        every leased row and acknowledge it.
        """
        stage = self.build(make_backend)
        batch = self.make_batch(self.rows)
        self.inputs(stage)
        ctx, written = run(self.through_the_loop(stage, batch))
        assert written.num_rows == batch.num_rows, f"{written.num_rows} of {batch.num_rows} rows were written"
        self.check_columns(stage, batch, {n: written[n] for n in stage.produces}, "the loop")
        assert ctx.processed[stage.name] == batch.num_rows

    def test_a_drop_filters_exactly_the_dropped_rows(self, make_backend):
        """Rows ``process`` drops are marked filtered (their prompt groups are then dropped) and counted; no others.

        A row's fate follows the row, not its position: the same rows leased
        in another order (whole prompt groups moved) are dropped alike. Fix:
        return ``drop`` as one bool per input row, in the rows' order.
        """
        stage = self.build(make_backend)
        batch = self.make_batch(self.rows)
        # the prompt groups rotated by one (a lease may hand rows out in any order; groups stay whole)
        order = (torch.arange(self.rows) + self.group_size) % self.rows

        async def direct():
            await stage.setup()
            inputs = self.inputs(stage)
            return await stage.process(inputs), await stage.process(inputs.select(order))

        out, shuffled = run(direct())
        if out.drop is None or not bool(out.drop.to(torch.bool).any()):
            pytest.skip("the stage dropped no row of the suite's batch (override make_batch, or options, so it drops "
                        "some)")
        moved = shuffled.drop is not None and torch.equal(shuffled.drop.to(torch.bool), out.drop.to(torch.bool)[order])
        assert moved, (
            "the same rows in another order were dropped differently: drop must be aligned with the batch's rows"
        )
        dropped = set(out.drop.to(torch.bool).nonzero().squeeze(1).tolist())
        stage = self.build(make_backend)
        rows: list[int] = []
        ctx, _ = run(self.through_the_loop(stage, batch, rows.extend))
        marked = {row for row, why in ctx.outcomes.reasons.items()
                  if why.outcome is RowOutcome.FILTERED and why.stage == stage.name}
        assert marked == {rows[i] for i in dropped}, (
            f"rows marked filtered {sorted(marked)}, but process dropped batch rows {sorted(dropped)} "
            f"(store rows {sorted(rows[i] for i in dropped)})"
        )
        assert ctx.counters[f"filtered_{stage.name}"] == len(dropped)

    def test_a_failing_row_is_recorded_and_the_others_go_on(self, make_backend):
        """A row ``process`` fails on is recorded with the error and gets placeholder outputs in the declared dtypes.

        The suite makes ``process`` raise whenever one chosen row is in the
        batch; the runtime retries row by row. Fix: when a produced column
        is not float32, override ``placeholder`` to return that column's
        dtype.
        """
        stage = self.build(make_backend)
        batch = self.make_batch(self.rows)
        self.inputs(stage)
        original = stage.process
        poisoned: list[int] = []

        async def failing(sub: Batch) -> StageOutput:
            if poisoned and sub.row_ids is not None and poisoned[0] in sub.row_ids.tolist():
                raise RuntimeError("the suite's injected failure")
            return await original(sub)

        stage.process = failing  # type: ignore[method-assign]

        # the fourth row of the batch is the one process() fails on
        ctx, written = run(self.through_the_loop(stage, batch, lambda ids: poisoned.append(ids[3])))
        why = ctx.outcomes.reasons.get(poisoned[0])
        assert why is not None and why.outcome is RowOutcome.FAILED and why.stage == stage.name, ctx.outcomes.reasons
        assert why.detail.endswith("the suite's injected failure"), why
        assert ctx.counters[f"failed_{stage.name}"] == 1
        self.check_columns(stage, batch, {n: written[n] for n in stage.produces}, "placeholder rows")
        assert ctx.processed[stage.name] == batch.num_rows
        good = [i for i in range(batch.num_rows) if i != 3]
        expected = run(self._direct(original, batch.select(torch.tensor(good)).project(list(stage.consumes))))
        for name in stage.produces:
            got, want = written.select(torch.tensor(good))[name], expected[name]
            assert _same(got, want), f"{name} of the rows that did not fail differs from process() on them alone"

    @staticmethod
    async def _direct(process: Any, batch: Batch) -> dict[str, Any]:
        return dict((await process(batch)).columns)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, RaggedTensor) or isinstance(b, RaggedTensor):
        return (isinstance(a, RaggedTensor) and isinstance(b, RaggedTensor) and torch.equal(a.values, b.values)
                and torch.equal(a.offsets, b.offsets))
    return torch.equal(a, b)
