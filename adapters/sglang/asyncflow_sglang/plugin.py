"""Hook implementations of the ``sglang`` rollout engine (the ``asyncflow`` entry point of asyncflow-sglang).

Only the options model is imported here; httpx, torch.distributed and the
engine are imported by the factory, so ``asyncflow plugins`` stays fast.
"""

from __future__ import annotations

from asyncflow_core.plugins import RolloutEngineBackend, hookimpl
from asyncflow_sglang.config import DECLARED_FEATURES, SGLangRolloutConfig


def _make(config: SGLangRolloutConfig):
    from asyncflow_sglang.engine import SGLangRolloutEngine

    return SGLangRolloutEngine(config)


@hookimpl
def asyncflow_rollout_engines():
    yield RolloutEngineBackend(
        name="sglang",
        factory=_make,
        config_model=SGLangRolloutConfig,
        description="An SGLang server (started here or at a url) over its HTTP API: log-probs, abort, pause, "
        "weight updates by torch.distributed broadcast.",
        features=DECLARED_FEATURES,
    )
