"""asyncflow-fsdp: the ``fsdp`` TrainEngine on PyTorch FSDP2.

The engine object lives in the driver process and spawns its ranks; see
:mod:`asyncflow_fsdp.engine` (driver side), :mod:`asyncflow_fsdp.worker`
(rank side) and docs/adapters/fsdp.md.
"""

from __future__ import annotations

from asyncflow_fsdp.config import FSDPTrainConfig

__all__ = ["FSDPTrainConfig"]
