"""LoRA adapters: the ``trainer.lora`` section, shared by the train engines and the rollout engines.

A run with ``trainer.lora`` trains a low-rank adapter (``peft``'s LoRA) on
top of frozen base weights. Trainer and rollout engines start from the same
base weights (the same checkpoint, or the same seed for ``model.hf_config``);
the first weight update (version 0) may carry the whole model as without
LoRA, every later one only the adapter: the tensors
:func:`adapter_state_dict` names (``peft.get_peft_model_state_dict`` keys,
adapter name stripped, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), plus
those of ``modules_to_save``. A rollout engine receives them with
``collect_update(version, buckets, model=..., partial=names)``.

``peft`` is imported only when an adapter is built, so this module stays
cheap to import (the config models use :class:`LoraSpec`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: attention and MLP projections of Qwen2 / Llama / Mistral decoder layers
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(BaseModel):
    """A LoRA adapter to train instead of the full model (``trainer.lora``; its presence turns LoRA on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1, description="Rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input, in train_step only (log-probs never drop)."
    )
    target_modules: tuple[str, ...] = Field(
        DEFAULT_TARGET_MODULES,
        description="Names (last path component) of the linear layers that get an adapter; default: the attention "
        "and MLP projections of Qwen2/Llama.",
    )
    modules_to_save: tuple[str, ...] = Field(
        (), description="Modules trained in full beside the adapter (e.g. lm_head); their weights travel with it."
    )
    export: Literal["merged", "adapter"] = Field(
        "merged", description="What export_pretrained writes: merged (a plain Hugging Face model with the adapter "
        "folded in) or adapter (a peft adapter directory for PeftModel.from_pretrained)."
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("trainer.lora.target_modules is empty: name at least one linear layer (e.g. q_proj)")
        return v

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` of this adapter (task ``CAUSAL_LM``, no bias training)."""
        try:
            import peft
        except ImportError as exc:  # pragma: no cover - depends on the environment
            from asyncflow_core.errors import ConfigError

            raise ConfigError("trainer.lora needs peft: pip install 'asyncflow[lora]' (or pip install peft)") from exc
        return peft.LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules),
            modules_to_save=list(self.modules_to_save) or None, bias="none", task_type="CAUSAL_LM",
        )


def wrap(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """``model`` (a Hugging Face causal LM) as a ``peft`` model with ``spec``'s adapter; the base is frozen.

    ``ValueError`` in one line when no module of the model matches ``target_modules``.
    """
    import peft

    try:
        return peft.get_peft_model(model, spec.peft_config())
    except ValueError as exc:
        if "not found in the base model" in str(exc) or "Target modules" in str(exc):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if type(m).__name__ == "Linear"})
            raise ValueError(f"trainer.lora.target_modules {list(spec.target_modules)} match no layer of "
                             f"{type(model).__name__}; its linear layers are {linear}") from None
        raise


def adapter_state_dict(model: torch.nn.Module, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """The adapter's tensors of a ``peft`` model by their exported names (``peft.get_peft_model_state_dict``).

    With ``state_dict`` (the model's own, e.g. ``state_dict(keep_vars=True)``
    of a sharded model) the values are taken from it. Embedding layers are
    included only when they are adapted or in ``modules_to_save``.
    """
    import peft

    return peft.get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)


__all__ = ["DEFAULT_TARGET_MODULES", "LoraSpec", "adapter_state_dict", "wrap"]
