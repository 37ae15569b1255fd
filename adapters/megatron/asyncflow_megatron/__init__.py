"""asyncflow-megatron: the ``megatron`` TrainEngine on megatron-core.

The engine object lives in the driver process and spawns its ranks; see
:mod:`asyncflow_megatron.engine` (driver side), :mod:`asyncflow_megatron.worker`
(rank side), :mod:`asyncflow_megatron.hf_mapping` (Hugging Face <-> Megatron
names and layouts) and docs/adapters/megatron.md.
"""

from __future__ import annotations

from asyncflow_megatron.config import MegatronTrainConfig

__all__ = ["MegatronTrainConfig"]
