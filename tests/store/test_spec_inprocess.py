"""The conformance suite and the stateful model check against the in-process store."""

from __future__ import annotations

from asyncflow_core.store.inprocess import InProcessStore
from asyncflow_spec import StoreSpec
from asyncflow_spec.store import make_store_state_machine


class TestInProcessStore(StoreSpec):
    backend = "inprocess"


def _create(*, capacity: int, lease_s: float, clock):
    return InProcessStore(capacity=capacity, lease_s=lease_s, clock=clock)


TestInProcessStoreMachine = make_store_state_machine(_create, max_examples=60, stateful_step_count=30).TestCase
