"""The step plan moved to the core, where every rank-group train engine (fsdp, megatron) shares it.

:mod:`asyncflow_core.launchers.packing` holds :func:`plan_step` and its
parts. This module keeps the old import path working.
"""

from __future__ import annotations

from asyncflow_core.launchers.packing import StepPlan, micro_batches, plan_step, split_across_ranks

__all__ = ["StepPlan", "micro_batches", "plan_step", "split_across_ranks"]
