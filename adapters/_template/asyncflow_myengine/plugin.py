"""The hook implementations asyncflow loads through the ``asyncflow`` entry point.

Hooks only register: they return records naming the engine, its config model,
its features and a factory. The factory imports the engine (and torch) only
when a run or a test actually builds one.
"""

from __future__ import annotations

from asyncflow_core.plugins import RolloutEngineBackend, hookimpl
from asyncflow_myengine.config import FEATURES, MyEngineConfig


def _make(config: MyEngineConfig):
    from asyncflow_myengine.engine import MyEngine

    return MyEngine(config)


@hookimpl
def asyncflow_rollout_engines():
    yield RolloutEngineBackend(
        name="myengine",
        factory=_make,
        config_model=MyEngineConfig,
        description="A Hugging Face causal LM decoded request by request; the adapter template to copy.",
        features=FEATURES,
    )
