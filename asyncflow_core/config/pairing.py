"""Does the trainer's weight export fit the rollout engine? Checked from the configs alone, no weights loaded.

A run whose rollout engine refuses the trainer's tensors fails at the first
weight push, after every engine started. ``asyncflow config validate``
asks both sides instead, through two optional methods of the options
models their plugins register (docs/plugins.md, "Weight pairing"):

- the trainer's options: ``exported_weights(model) -> {name: shape}``,
  what ``export_weights`` sends. A trainer whose options have a ``model``
  field and no such method exports the Hugging Face convention of the
  shipped trainers (:func:`asyncflow_core.config.hf.hf_export`, built on the
  meta device);
- the rollout engine's options: ``accepts_weights(model, weights)``, which
  raises ``ValueError`` (or ``ConfigError``) with one line when the engine
  would refuse ``weights``; :func:`check_against` does the usual checks.

``model`` is the policy the side serves: its own ``model`` option, else the
run's ``model`` section. A side that declares nothing is reported as not
checked, never as fine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow_core.config.loader import ResolvedConfig
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import ConfigError
from asyncflow_core.types import ModelTensors


def check_against(model: ModelTensors, weights: Mapping[str, Sequence[int]]) -> None:
    """``ValueError`` unless ``weights`` name only tensors of ``model``, with its shapes, covering all of it.

    A tied group (one tensor under several names) is covered by any of its names.
    """
    unknown = [name for name in weights if name not in model.specs]
    if unknown:
        example = next(iter(model.specs), "")
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ValueError(f"{unknown[0]!r}{more} is not a tensor of the engine's model (its names are e.g. "
                         f"{example!r})")
    for name, shape in weights.items():
        want = model.specs[name][0]
        if tuple(shape) != tuple(want):
            raise ValueError(f"{name}: shape {tuple(shape)} does not match the engine's {tuple(want)}")
    missing = model.missing(weights)
    if missing:
        raise ValueError(f"the export leaves {len(missing)} of the engine's tensors unset, e.g. {missing[0]!r}")


def _model(options: Any, config: Any) -> ModelConfig:
    own = getattr(options, "model", None)
    return own if isinstance(own, ModelConfig) else config.model


def _exported(options: Any, config: Any) -> Mapping[str, Sequence[int]] | str:
    """The trainer's export listing, or why there is none."""
    model = _model(options, config)
    listing = getattr(options, "exported_weights", None)
    if callable(listing):
        return listing(model)
    if "model" in getattr(type(options), "model_fields", {}) and (model.path or model.hf_config):
        from asyncflow_core.config.hf import hf_export

        return hf_export(model)
    return (f"trainer {config.trainer.name!r} does not list what it exports (exported_weights on its options "
            "model, docs/plugins.md)")


def check_weight_pairing(resolved: ResolvedConfig) -> str | None:
    """``None`` when the rollout engine accepts what the trainer exports; else why it was not checked.

    A mismatch is a one-line :class:`ConfigError` naming both plugins and the first tensor at fault.
    """
    cfg = resolved.config
    rollout, trainer = resolved.components.get("rollout"), resolved.components.get("trainer")
    if rollout is None or trainer is None:
        return "the rollout engine or the trainer was not resolved"
    accepts = getattr(rollout.options, "accepts_weights", None)
    if not callable(accepts):
        return (f"rollout engine {cfg.rollout.name!r} does not declare which weights it accepts (accepts_weights "
                "on its options model, docs/plugins.md)")
    weights = _exported(trainer.options, cfg)
    if isinstance(weights, str):
        return weights
    try:
        accepts(_model(rollout.options, cfg), weights)
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"rollout engine {cfg.rollout.name!r} would refuse the weights trainer "
                          f"{cfg.trainer.name!r} exports: {exc}") from None
    return None
