"""The start-up heap is frozen while a run steps and handed back to the collector when it stops (flow/heap.py)."""

from __future__ import annotations

import gc

import pytest

from asyncflow_core.config.loader import resolve
from asyncflow_core.flow import heap, runtime
from asyncflow_core.flow.runtime import run_flow
from tests.flow.test_flow_sim import sim_config


@pytest.mark.parametrize("fail", [False, True])
def test_a_run_freezes_its_start_up_heap_and_thaws_it_at_the_stop(monkeypatch, fail):
    frozen: list[int] = []

    def freeze() -> None:
        heap.freeze_startup()
        frozen.append(gc.get_freeze_count())
        if fail:
            raise RuntimeError("a failure right after the freeze")

    monkeypatch.setattr(runtime, "freeze_startup", freeze)
    assert gc.get_freeze_count() == 0
    if fail:
        with pytest.raises(RuntimeError, match="right after the freeze"):
            run_flow(resolve(sim_config(steps=2)), virtual=True, write_png=False)
    else:
        run_flow(resolve(sim_config(steps=2)), virtual=True, write_png=False)
    assert len(frozen) == 1 and frozen[0] > 0  # the objects alive at the first step were exempted
    assert gc.get_freeze_count() == 0  # and given back, even when the run failed
