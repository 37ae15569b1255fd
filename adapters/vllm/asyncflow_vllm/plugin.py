"""Hook implementations of the ``vllm`` rollout engine (the ``asyncflow`` entry point of asyncflow-vllm).

Only the options model is imported here; vLLM is imported when an engine
starts, so ``asyncflow plugins`` stays fast and works without vLLM installed.
"""

from __future__ import annotations

from asyncflow_core.plugins import RolloutEngineBackend, hookimpl
from asyncflow_vllm.config import DECLARED_FEATURES, VLLMRolloutConfig


def _make(config: VLLMRolloutConfig):
    from asyncflow_vllm.engine import VLLMRolloutEngine

    return VLLMRolloutEngine(config)


@hookimpl
def asyncflow_rollout_engines():
    yield RolloutEngineBackend(
        name="vllm",
        factory=_make,
        config_model=VLLMRolloutConfig,
        description="vLLM's AsyncLLM: token ids in and out, processed log-probs, per-token weight versions, "
        "abort, pause/keep, bucketed weight updates over torch.distributed (gloo on CPU, NCCL on GPU).",
        features=DECLARED_FEATURES,
    )
