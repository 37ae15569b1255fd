"""Options of the ``fsdp`` train engine (validated by the plugin manager from the config's ``options``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import TrainFeatures
from asyncflow_core.types.adapter import LoraSpec

#: What the registration declares (``asyncflow plugins`` shows it): the defaults.
#: An engine built with ``value_head: true`` reports ``supports_values=True``.
DECLARED_FEATURES = TrainFeatures(
    supports_values=False, supports_checkpoint=True, supports_hf_export=True, supports_lora=True,
    weight_transports=("inprocess",)
)


class FSDPTrainConfig(BaseModel):
    """Options of the ``fsdp`` train engine.

    ``model``, ``temperature``, ``top_p`` and ``top_k`` are filled from the
    run's ``model`` and ``rollout`` sections when left unset, so trainer and
    rollout share one policy and one log-prob convention; ``lora`` from
    ``trainer.lora``.
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig | None = Field(
        None, description="The policy (a local checkpoint or an hf_config to build); defaults to the run's `model`."
    )
    seed: int = Field(0, description="Seed of randomly initialised weights (match the rollout engine's).")
    temperature: float = Field(1.0, gt=0, description="Temperature of the log-prob convention (match the rollout's).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass of the log-prob convention (match the rollout's).")
    top_k: int = Field(-1, ge=-1, description="Top-k of the log-prob convention; -1 disables it (match the rollout's).")

    world_size: int = Field(1, ge=1, description="Ranks the engine spawns (one process each; one GPU each on CUDA).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA (NCCL) when world_size GPUs are visible, else CPU (gloo)."
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver",
        description="How ranks start: forkserver forks them from a server that imported torch once (fast); "
        "spawn starts fresh interpreters. Never a fork of the driver.",
    )
    cpu_threads_per_rank: int | None = Field(
        None, ge=1, description="torch threads per rank on CPU; default: the CPU count divided by world_size + 1 "
        "(at least 1): the driver's process, where the rollout engine generates beside training, keeps a share, and "
        "keeps to it: with CPU ranks on its host, setup lowers its own torch threads to the cores left."
    )
    shard: Literal["auto", "always", "never"] = Field(
        "auto", description="Wrap the model in FSDP2 (fully_shard). auto: not at world_size 1 unless a GPU "
        "mixed-precision policy applies (at one rank sharding only adds per-call work); always: also at world 1; "
        "never: world_size 1 only. Checkpoints, exports and log-probs are the same either way."
    )

    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global gradient norm (over all ranks) to this.")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one micro-batch per rank: rows x longest row (prompt + response)."
    )
    share_prompts: bool = Field(
        True, description="Rows of a micro-batch with the same prompt (a GRPO group) run the prompt once: one "
        "sequence per prompt with a 4-D attention mask (llama, qwen2, qwen3, mistral with sdpa or eager attention; "
        "others, or when it is not smaller, the padded rectangle). Same log-probs and gradients up to rounding."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (less memory).")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered parameters after each forward.")
    mixed_precision: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Compute dtype on GPU (FSDP2 MixedPrecisionPolicy; gradients reduced in float32). "
        "CPU always computes in float32."
    )
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of exported weights (export_weights, export_hf); auto: the model's `dtype`."
    )
    lora: LoraSpec | None = Field(
        None, description="Train a peft LoRA adapter on the frozen model instead of all of it; defaults to the "
        "run's `trainer.lora`. export_weights sends the whole model at version 0, then only the adapter's tensors."
    )
    value_head: bool = Field(
        False, description="Add a scalar value head on the last hidden state (compute_logprobs(values=True)); "
        "trained by the algorithm's value_loss when it has one."
    )

    setup_timeout_s: float = Field(300.0, gt=0, description="Deadline for starting the ranks and building the model.")
    timeout_s: float = Field(
        600.0, gt=0, description="Deadline for one command (a train step, a checkpoint, one export bucket)."
    )

    @model_validator(mode="after")
    def _check(self) -> FSDPTrainConfig:
        for b in self.betas:
            if not 0 <= b < 1:
                raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if self.shard == "never" and self.world_size > 1:
            raise ValueError(f"shard: never needs world_size 1 (got {self.world_size}): ranks share the model "
                             "through FSDP; use shard: auto")
        return self

    def sharded(self, device_type: str) -> bool:
        """Whether the ranks wrap the model in FSDP2 on ``device_type`` (``cpu`` or ``cuda``)."""
        if self.shard == "always" or self.world_size > 1:
            return True
        if self.shard == "never":
            return False
        # auto at one rank: only where FSDP2 also supplies the GPU's bf16 compute (its MixedPrecisionPolicy)
        return device_type == "cuda" and self.mixed_precision == "bfloat16"

    def features(self) -> TrainFeatures:
        """The capabilities of an engine built from these options."""
        return DECLARED_FEATURES.model_copy(update={"supports_values": self.value_head})
