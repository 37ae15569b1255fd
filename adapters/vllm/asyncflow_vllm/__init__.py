"""asyncflow-vllm: the ``vllm`` rollout engine (vLLM's AsyncLLM behind the RolloutEngine contract).

Importing this package does not import vLLM; the engine module does, when
the plugin's factory builds an engine.
"""

from asyncflow_vllm.config import SUPPORTED_VLLM, VLLMRolloutConfig

__all__ = ["SUPPORTED_VLLM", "VLLMRolloutConfig"]
