"""The Hugging Face view of the run's ``model`` section: its ``transformers`` config, and its tensors without weights.

``hf_config`` reads ``model.path``'s ``config.json`` (never a hub download)
or builds the architecture ``model.hf_config`` names. The listings build the
model on PyTorch's ``meta`` device: every parameter's name and shape, no
memory and no weights, so ``asyncflow config validate`` can check that a
trainer's export fits a rollout engine before anything is loaded.

Imported only where it is used (it imports ``transformers``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError

#: a model's tensors for a pairing check: name -> shape
Shapes = dict[str, tuple[int, ...]]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency
        raise ConfigError("Hugging Face models need transformers: pip install transformers") from exc
    return transformers


def hf_config(model: ModelConfig) -> Any:
    """The ``transformers`` config object of ``model`` (read from the checkpoint or built from ``hf_config``)."""
    tf = _transformers()
    if model.path is not None:
        path = Path(model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path {model.path!r} is not a Hugging Face checkpoint directory (no config.json)")
        return tf.AutoConfig.from_pretrained(str(path), trust_remote_code=model.trust_remote_code,
                                             local_files_only=True)
    if model.hf_config is None:
        raise ConfigError("set model.path (a local checkpoint) or model.hf_config (an architecture to build)")
    options = dict(model.hf_config)
    model_type = options.pop("model_type", None)
    if not model_type:
        raise ConfigError("model.hf_config needs a model_type (e.g. qwen2 or llama)")
    # a built model reads the character tokenizer: the architecture's default special ids (Llama: bos 1, eos 2)
    # would be the characters "1" and "2"; only model.eos is special, the others are left unset (ids given in
    # hf_config are kept: a run refuses those that are answer characters, see ModelConfig.special_token_problem)
    options.setdefault("eos_token_id", model.alphabet.index(model.eos) if model.eos is not None else None)
    options.setdefault("bos_token_id", None)
    options.setdefault("pad_token_id", None)
    try:
        return tf.AutoConfig.for_model(model_type, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.hf_config: {exc}") from exc


def meta_tensors(model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The causal LM's ``state_dict`` (keep_vars) built on the meta device: names, shapes, tied tensors shared."""
    tf = _transformers()
    cfg = hf_config(model)
    try:
        with torch.device("meta"):
            net = tf.AutoModelForCausalLM.from_config(cfg, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot build the model's architecture ({type(exc).__name__}: {exc})") from None
    return list(net.state_dict(keep_vars=True).items())


def hf_export(model: ModelConfig) -> Shapes:
    """Names and shapes of what a Hugging Face trainer exports: ``state_dict`` keys, a tied tensor once (first name).

    The convention of the shipped trainers (``fsdp``, ``megatron``): what
    ``TrainEngine.export_weights`` sends for ``model``.
    """
    seen: set[int] = set()
    out: Shapes = {}
    for name, tensor in meta_tensors(model):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[name] = tuple(tensor.shape)
    return out
