"""The streaming store (TransferQueue): control plane, data plane and the in-process deployment.

- :class:`~asyncflow_core.store.controller.Controller`: rows, readiness, per-task leases (no data).
- :class:`~asyncflow_core.store.storage.StorageUnit`: column values, dense and packed ragged.
- :class:`~asyncflow_core.store.inprocess.InProcessStore`: both in the caller's process (the default).
- :class:`~asyncflow_core.store.sync.SyncStore`: blocking facade over any store for non-async code.
- :class:`~asyncflow_core.store.lease.LeaseKeeper`: renews a lease held longer than one ``lease_s`` (an episode).

Other deployments live in ``asyncflow_core.store.deployments`` and reuse the first two.
"""

from asyncflow_core.store.controller import Controller
from asyncflow_core.store.errors import (
    ColumnTypeError,
    InvalidRequestError,
    LeaseError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
    UnknownColumnError,
    UnknownRowError,
)
from asyncflow_core.store.lease import LeaseKeeper
from asyncflow_core.store.storage import StorageUnit

__all__ = [
    "ColumnTypeError",
    "Controller",
    "InvalidRequestError",
    "LeaseError",
    "LeaseKeeper",
    "StorageUnit",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreTimeoutError",
    "UnknownColumnError",
    "UnknownRowError",
]
