"""Building a Hugging Face causal LM from the run's ``model`` section (shared by the ``torch`` engine and trainers).

``model.path`` loads a local checkpoint directory (never a hub download);
``model.hf_config`` builds the architecture it names (``model_type``, e.g.
``qwen2`` or ``llama``) with random weights drawn from ``seed``, so a test or a
toy run gets the same initial policy in every process that builds it.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncflow_core.config.hf import hf_config
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError, EngineError

__all__ = ["DTYPES", "build_causal_lm", "hf_config", "vocab_size"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency of these engines
        raise ConfigError("Hugging Face models need transformers: pip install transformers") from exc
    return transformers


def build_causal_lm(model: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The policy as a ``transformers`` causal LM in ``model.dtype`` on ``device``, in eval mode.

    Weights come from ``model.path``, or are drawn from ``seed`` for
    ``model.hf_config`` (the same seed gives bit-identical weights).
    """
    tf = _transformers()
    cfg = hf_config(model)
    dtype = DTYPES[model.dtype]
    try:
        if model.path is not None:
            net = tf.AutoModelForCausalLM.from_pretrained(
                model.path, config=cfg, dtype=dtype, trust_remote_code=model.trust_remote_code, local_files_only=True
            )
        else:
            # the weights are drawn on the CPU; manual_seed also reseeds CUDA, whose state the fork restores.
            # A bare "cuda" has no index: fork_rng needs one (torch.cuda.get_rng_state reads device.index)
            where = torch.device(device)
            fork = [torch.cuda.current_device() if where.index is None else where.index] if where.type == "cuda" else []
            with torch.random.fork_rng(devices=fork):
                torch.manual_seed(seed)
                net = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            net = net.to(dtype)
    except (OSError, ValueError) as exc:
        raise EngineError(f"could not build the model ({type(exc).__name__}: {exc})") from exc
    return net.to(device).eval()


def vocab_size(model: ModelConfig) -> int:
    """Rows of the model's embedding (token ids must be below it)."""
    return int(hf_config(model).vocab_size)
