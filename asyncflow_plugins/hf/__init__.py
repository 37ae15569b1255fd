"""Hugging Face ``transformers`` models: the ``torch`` reference rollout engine and the shared model builder.

The engine lives in :mod:`asyncflow_plugins.hf.rollout` (imported only when
it is used, so discovery does not import ``transformers``); the model builder
shared with trainers in :mod:`asyncflow_plugins.hf.model`.
"""

from __future__ import annotations

from asyncflow_core.plugins import RolloutEngineBackend, hookimpl


def _make_rollout(config):
    from asyncflow_plugins.hf.rollout import TorchRolloutEngine

    return TorchRolloutEngine(config)


@hookimpl
def asyncflow_rollout_engines():
    from asyncflow_plugins.hf.rollout import FEATURES, TorchRolloutConfig

    yield RolloutEngineBackend(
        name="torch",
        factory=_make_rollout,
        config_model=TorchRolloutConfig,
        description="Any Hugging Face causal LM in plain PyTorch: continuous batching with a KV cache, CPU or CUDA.",
        features=FEATURES,
    )
