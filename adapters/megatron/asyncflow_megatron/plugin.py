"""Hook implementations of the ``megatron`` train engine (the ``asyncflow`` entry point of asyncflow-megatron).

Only the options model is imported here; megatron-core, torch.distributed and
transformers are imported by the factory and the ranks, so ``asyncflow
plugins`` stays fast and works without megatron-core installed.
"""

from __future__ import annotations

from asyncflow_core.plugins import TrainEngineBackend, hookimpl
from asyncflow_megatron.config import DECLARED_FEATURES, MegatronTrainConfig


def _make(config: MegatronTrainConfig):
    from asyncflow_megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(config)


@hookimpl
def asyncflow_train_engines():
    yield TrainEngineBackend(
        name="megatron",
        factory=_make,
        config_model=MegatronTrainConfig,
        description="Qwen2/Qwen3/Llama policy on megatron-core: TP/PP/DP ranks, distributed optimizer, "
        "dist_checkpointing, export renamed to Hugging Face names.",
        features=DECLARED_FEATURES,
    )
