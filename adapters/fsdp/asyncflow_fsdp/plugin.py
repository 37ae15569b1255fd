"""Hook implementations of the ``fsdp`` train engine (the ``asyncflow`` entry point of asyncflow-fsdp).

Only the options model is imported here; torch.distributed and transformers
are imported by the factory, so ``asyncflow plugins`` stays fast.
"""

from __future__ import annotations

from asyncflow_core.plugins import TrainEngineBackend, hookimpl
from asyncflow_fsdp.config import DECLARED_FEATURES, FSDPTrainConfig


def _make(config: FSDPTrainConfig):
    from asyncflow_fsdp.engine import FSDPTrainEngine

    return FSDPTrainEngine(config)


@hookimpl
def asyncflow_train_engines():
    yield TrainEngineBackend(
        name="fsdp",
        factory=_make,
        config_model=FSDPTrainConfig,
        description="Hugging Face causal LM trained with FSDP2 on spawned ranks (gloo on CPU, NCCL on GPU).",
        features=DECLARED_FEATURES,
    )
