"""Options of the ``megatron`` train engine (validated by the plugin manager from the config's ``options``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import TrainFeatures
from asyncflow_core.types.adapter import LoraSpec

#: What the registration declares (``asyncflow plugins`` shows it). No value head: PPO critics are not supported yet.
DECLARED_FEATURES = TrainFeatures(
    supports_values=False, supports_checkpoint=True, supports_hf_export=True, weight_transports=("inprocess",)
)


#: why trainer.lora is refused (one line; docs/adapters/megatron.md)
LORA_REFUSAL = ("trainer.lora: the megatron trainer does not train LoRA adapters (supports_lora is false); use "
                "trainer.name: fsdp for LoRA, or remove trainer.lora")


class MegatronTrainConfig(BaseModel):
    """Options of the ``megatron`` train engine.

    The ranks form a ``tensor_parallel_size x pipeline_parallel_size x DP``
    grid with ``DP = world_size / (tensor_parallel_size * pipeline_parallel_size)``.
    ``model``, ``temperature``, ``top_p`` and ``top_k`` are filled from the
    run's ``model`` and ``rollout`` sections when left unset, so trainer and
    rollout share one policy and one log-prob convention.
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig | None = Field(
        None, description="The policy (a local Hugging Face checkpoint or an hf_config to build); "
        "defaults to the run's `model`. Qwen2, Qwen3, Llama and Mistral (no sliding window) are supported."
    )
    seed: int = Field(0, description="Seed of randomly initialised weights (match the rollout engine's).")
    temperature: float = Field(1.0, gt=0, description="Temperature of the log-prob convention (match the rollout's).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass of the log-prob convention (match the rollout's).")
    top_k: int = Field(-1, ge=-1, description="Top-k of the log-prob convention; -1 disables it (match the rollout's).")

    world_size: int = Field(1, ge=1, description="Ranks the engine spawns (one process and one GPU each).")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel ranks per model replica (TP).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages per model replica (PP).")
    sequence_parallel: bool = Field(
        False, description="Megatron sequence parallelism in the TP group (needs tensor_parallel_size > 1 and "
        "Transformer Engine layers)."
    )
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cuda: one GPU per rank, NCCL. cpu: gloo, for tests on machines without a GPU only "
        "(megatron-core is CUDA-only; asyncflow_megatron.cpu patches its few CUDA calls; slow)."
    )
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        "auto", description="Layer implementation: transformer_engine (fused kernels, needs transformer-engine), "
        "local (megatron-core's own modules), auto: transformer_engine when importable on CUDA, else local."
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "spawn", description="How ranks start: spawn starts fresh interpreters (safe with CUDA); forkserver "
        "forks them from a server that imported torch and megatron once (faster start)."
    )
    cpu_threads_per_rank: int | None = Field(
        None, ge=1, description="torch threads per rank on CPU; default: the CPU count divided by world_size."
    )

    params_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Dtype of the model parameters and compute on GPU (the distributed optimizer "
        "keeps float32 main weights). CPU always uses float32."
    )
    use_distributed_optimizer: bool = Field(
        True, description="Shard optimizer state (and float32 main weights) over the data-parallel ranks."
    )
    lr: float = Field(1e-6, gt=0, description="Adam learning rate (constant).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW).")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global gradient norm (over all ranks) to this.")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one micro-batch per data-parallel replica: rows x longest row."
    )
    recompute_activations: bool = Field(
        False, description="Recompute every transformer layer in backward (full, uniform): less activation memory."
    )
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of exported weights (export_weights, export_pretrained); auto: the model's `dtype`."
    )

    lora: LoraSpec | None = Field(
        None, description="Filled from trainer.lora, which this engine refuses (UnsupportedFeatureError): "
        "megatron-core LoRA is not wired in; use the fsdp trainer for LoRA."
    )

    setup_timeout_s: float = Field(600.0, gt=0, description="Deadline for starting the ranks and building the model.")
    timeout_s: float = Field(
        600.0, gt=0, description="Deadline for one command (a train step, a checkpoint, one export bucket)."
    )

    @model_validator(mode="after")
    def _check(self) -> MegatronTrainConfig:
        for b in self.betas:
            if not 0 <= b < 1:
                raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        grid = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size % grid:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of tensor_parallel_size x pipeline_parallel_size "
                f"= {self.tensor_parallel_size} x {self.pipeline_parallel_size} = {grid}; set world_size to a "
                f"multiple of {grid} (the rest is data parallelism)")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_parallel_size > 1; turn it off or raise "
                             "tensor_parallel_size")
        if self.sequence_parallel and (self.transformer_impl == "local" or self.device == "cpu"):
            raise ValueError("sequence_parallel needs transformer_impl transformer_engine (or auto) on cuda: "
                             "megatron-core's local RMSNorm does not support sequence parallelism")
        if self.device == "cpu" and self.use_distributed_optimizer:
            raise ValueError("use_distributed_optimizer needs device cuda (megatron-core's DistributedOptimizer "
                             "accepts only CUDA parameters); set use_distributed_optimizer: false with device cpu")
        if self.device == "cpu" and self.transformer_impl == "transformer_engine":
            raise ValueError("transformer_impl transformer_engine needs device cuda; use local (or auto) on cpu")
        return self

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: ``world_size / (tensor_parallel_size * pipeline_parallel_size)``."""
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    def features(self) -> TrainFeatures:
        """The capabilities of an engine built from these options."""
        return DECLARED_FEATURES
