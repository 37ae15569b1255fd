"""Row outcomes (flow/outcomes.py): each row is settled once, counted under the keys the metrics report, and a
dropped group takes the most important reason of its rows."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.outcomes import RowOutcome, RowOutcomes, RowReason, merge_outputs
from asyncflow_core.flow.stage import FlowContext
from asyncflow_core.flow.telemetry import Timeline
from asyncflow_core.types import Batch, PromptRecord, RaggedTensor


def table() -> tuple[RowOutcomes, Counter[str]]:
    counters: Counter[str] = Counter()
    return RowOutcomes(lambda: counters), counters


def ids(*rows: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_each_outcome_is_counted_under_its_key_and_reads_as_its_line():
    out, counters = table()
    out.fail("reward", [3, 4], "ValueError: boom")
    out.filter("advantage", ids(5))
    out.stale(6)
    assert counters == Counter({"failed_reward": 2, "filtered_advantage": 1, "stale_rows_dropped": 1})
    assert out.failures() == 2
    assert out.reasons[3] == RowReason(RowOutcome.FAILED, "reward", "ValueError: boom")
    assert [str(out.reasons[r]) for r in (3, 5, 6)] == ["reward: ValueError: boom", "filtered:advantage", "stale"]
    assert [out.outcome(r) for r in (2, 3, 5, 6)] == [RowOutcome.OK, RowOutcome.FAILED, RowOutcome.FILTERED,
                                                      RowOutcome.STALE]


def test_the_first_reason_wins_but_every_event_is_counted():
    out, counters = table()
    out.filter("dyn", [1])
    out.fail("reward", [1], "late error")
    out.stale(1)
    assert out.outcome(1) is RowOutcome.FILTERED
    assert counters["failed_reward"] == 1 and counters["stale_rows_dropped"] == 1


def test_counters_are_read_at_call_time():
    # the runtime replaces the context's counters with the launcher's after building it
    ctx = FlowContext(store=None, timeline=Timeline(lambda: 0.0), ledger=Ledger(), k=1, prompts_per_step=1, n=1,
                      clock=lambda: 0.0)
    shared: Counter[str] = Counter()
    ctx.counters = shared
    ctx.fail_rows("reward", [7], "boom")
    assert shared["failed_reward"] == 1
    assert {r: str(why) for r, why in ctx.outcomes.reasons.items()} == {7: "reward: boom"}


def test_the_failure_rate_limit_halts_with_the_last_error():
    ctx = FlowContext(store=None, timeline=Timeline(lambda: 0.0), ledger=Ledger(), k=1, prompts_per_step=1, n=1,
                      clock=lambda: 0.0, max_failure_rate=0.25, min_samples_for_rate=4)
    ctx.processed["reward"] = 4
    ctx.fail_rows("reward", [1], "first")
    assert not ctx.stop.is_set()  # 1 of 4 is not above 0.25
    ctx.fail_rows("reward", [2], "second")
    assert ctx.stop.is_set() and "2 of 4 rows failed" in ctx.stop_reason and "second" in ctx.stop_reason


def test_masks_and_per_row_outcomes_with_groups():
    out, _ = table()
    rows, groups = ids(10, 11, 12, 13, 14, 15), ids(0, 0, 1, 1, 2, 2)
    assert not out.mask(rows).any() and out.group_reasons(rows, groups) == {}
    out.fail("reward", [11], "x")
    out.stale(14)
    assert out.mask(rows).tolist() == [False, True, False, False, True, False]
    assert out.group_mask(rows, groups).tolist() == [True, True, False, False, True, True]
    O = RowOutcome
    assert out.of_rows(rows, groups) == [O.DROPPED, O.FAILED, O.OK, O.OK, O.STALE, O.DROPPED]


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([None, "failed", "filtered", "stale"])),
                min_size=1, max_size=24))
def test_a_group_is_dropped_for_its_most_important_reason(rows):
    out, _ = table()
    for i, (_, why) in enumerate(rows):
        if why == "failed":
            out.fail("s", [i], "e")
        elif why == "filtered":
            out.filter("s", [i])
        elif why == "stale":
            out.stale(i)
    rank = ["failed", "filtered", "stale"]
    want: dict[int, str] = {}
    for g, why in rows:
        if why is not None and (g not in want or rank.index(why) < rank.index(want[g])):
            want[g] = why
    got = out.group_reasons(torch.arange(len(rows)), torch.tensor([g for g, _ in rows]))
    assert {g: o.value for g, o in got.items()} == want


def test_a_reason_prints_as_one_line_and_the_first_settlement_wins():
    out, _ = table()
    out.filter("adv", [2])
    out.fail("reward", [2], "late")  # already settled: the first reason stays
    out.stale(3)
    assert {r: str(why) for r, why in out.reasons.items()} == {2: "filtered:adv", 3: "stale"}


def test_the_ledger_records_the_outcome_word():
    led = Ledger()
    rec = PromptRecord(index=0, prompt="p")
    a, b = led.admit(0, rec), led.admit(1, rec)
    led.mark_dropped(a.group_id, RowOutcome.FILTERED)
    led.mark_requeued(b.group_id, RowOutcome.STALE)
    assert led.dropped == {0: "filtered"}
    assert led.counters == Counter({"dropped_filtered": 1, "requeued_stale": 1})


def test_merge_outputs_keeps_row_order_and_kinds():
    batch = Batch({"x": torch.zeros(4)})
    good = ids(0, 2, 3)
    values = {"d": torch.tensor([1.0, 3.0, 4.0]),
              "r": RaggedTensor.from_sequences([torch.tensor([1]), torch.tensor([3, 3]), torch.tensor([4])])}
    fill = {"d": torch.full((4,), -1.0),
            "r": RaggedTensor.from_sequences([torch.tensor([9]) for _ in range(4)])}
    out = merge_outputs(batch, good, values, fill)
    assert out["d"].tolist() == [1.0, -1.0, 3.0, 4.0]
    assert [out["r"][i].tolist() for i in range(4)] == [[1], [9], [3, 3], [4]]
    everything = merge_outputs(batch, ids(0, 1, 2, 3), {"d": torch.ones(4)}, {"d": torch.zeros(4)})
    assert everything["d"].tolist() == [1.0] * 4  # all rows computed: the values as they are
