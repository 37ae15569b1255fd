"""The run configuration: one pydantic model per section, strict, documented field by field.

A *component* section (rollout, trainer, store, sampler, weight_transport,
algorithm, reward, data, launcher) names a plugin with ``name`` and passes it
``options``, which are validated by the config model that plugin registered
(see :func:`asyncflow_core.config.resolve`). Generic fields that every
backend of a kind shares (batch sizes, sampling parameters, staleness) live
beside them, so switching engines never changes them.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow_core.types.adapter import LoraSpec


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class Component(StrictModel):
    """A plugin choice: its registered ``name`` and its ``options``."""

    name: str = Field(description="Registered plugin name (see `asyncflow plugins`).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Options for the plugin, validated by the config model it registered."
    )


class ModelConfig(StrictModel):
    """The policy model."""

    path: str | None = Field(None, description="Local Hugging Face checkpoint directory to load.")
    hf_config: dict[str, Any] | None = Field(
        None, description="A Hugging Face model config to build with random weights (tests, toy runs)."
    )
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$", description="Parameter dtype.")
    trust_remote_code: bool = Field(False, description="Allow model code shipped in the checkpoint to run.")
    system_prompt: str | None = Field(
        None,
        description="With `path`: a system message put first in every `messages` record that has none, before the "
        "checkpoint's chat template renders it.",
    )
    alphabet: str = Field(
        "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz.,?",
        description="Without `path`: a character tokenizer, token i = alphabet[i] (toy and simulated models).",
    )
    eos: str | None = Field(
        None,
        description="Without `path`: the alphabet character that ends a completion. Every rollout request lists it "
        "as its stop token, and a model built from `hf_config` gets it as eos_token_id (bos and pad left unset), "
        "so no answer character ends a completion. Default: the dataset's end marker (arithmetic: its "
        "terminator), else none (completions run to rollout.max_new_tokens).",
    )

    @field_validator("alphabet")
    @classmethod
    def _distinct(cls, value: str) -> str:
        twice = sorted({c for c in value if value.count(c) > 1})
        if not value or twice:
            what = f"repeats {''.join(twice)!r}" if twice else "is empty"
            raise ValueError(f"model.alphabet {what}; give each character once (token i = alphabet[i])")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and self.hf_config is not None:
            raise ValueError("set either model.path or model.hf_config, not both")
        if self.system_prompt is not None and self.path is None:
            raise ValueError("model.system_prompt is for chat records rendered by a checkpoint's chat template; "
                             "set model.path, or remove model.system_prompt")
        if self.eos is not None:
            if self.path is not None:
                raise ValueError("model.eos is for the character tokenizer; with model.path the checkpoint's EOS "
                                 "ends completions: remove model.eos")
            if len(self.eos) != 1 or self.eos not in self.alphabet:
                raise ValueError(f"model.eos {self.eos!r} must be one character of model.alphabet {self.alphabet!r}")
            if self.eos.isdigit():
                raise ValueError(f"model.eos {self.eos!r} is a digit, which answers use; pick a character such "
                                 "as '.' that only ends them")
        return self

    def special_token_problem(self) -> str | None:
        """Why the special token ids of ``hf_config`` clash with the character tokenizer, or None.

        With the character tokenizer, token ``i`` *is* ``alphabet[i]``: an
        ``eos_token_id`` (or ``bos``/``pad``) inside the alphabet is a real
        character, and an engine that ends completions on it can never write
        that character (a Llama config's default eos 2 is the digit "2").
        Only ``model.eos`` may be special.
        """
        if self.path is not None or not self.hf_config:
            return None
        end = self.alphabet.index(self.eos) if self.eos is not None else None
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = self.hf_config.get(key)
            ids = value if isinstance(value, list) else [value]
            for tid in ids:
                if isinstance(tid, int) and 0 <= tid < len(self.alphabet) and tid != end:
                    fix = (f"set it to {end} (model.eos {self.eos!r}) or remove it" if end is not None
                           else "set model.eos to the character that ends a completion, or remove it")
                    return (f"model.hf_config.{key}={tid} is {self.alphabet[tid]!r}, a character of model.alphabet, "
                            f"so a completion could never contain it; {fix}")
        return None


class DataConfig(Component):
    """Prompt dataset and how it is consumed."""

    name: str = Field("jsonl", description="Dataset plugin name.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per optimizer step (B); each yields `rollout.n` samples.")
    shuffle: bool = Field(True, description="Visit prompts in a seeded random order (reshuffled every epoch).")
    epochs: int = Field(1, ge=1, description="Passes over the dataset before the stream ends.")


class RolloutConfig(Component):
    """Inference engine replicas and how they sample."""

    name: str = Field("toy", description="Rollout engine plugin name.")
    replicas: int = Field(1, ge=1, description="Engine replicas serving rollouts.")
    n: int = Field(4, ge=1, description="Samples per prompt (the group size for group-based advantages).")
    max_new_tokens: int = Field(64, ge=1, description="Cap on generated tokens per sample.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used by the trainer's log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k cut-off; -1 disables it.")
    max_inflight: int = Field(256, ge=1, description="Most requests one replica works on at once (its batch/KV budget).")
    rows_per_lease: int = Field(
        256, ge=1,
        description="Most prompt rows the dispatcher leases from the store at once (it takes what is ready, up to "
        "this and the replicas' free slots); each lease is a few store calls, and its rows start together.",
    )
    kv_cache: str = Field(
        "recompute", pattern="^(keep|recompute)$",
        description="KV cache of requests held across an in-flight weight update: keep or recompute.",
    )

    @model_validator(mode="after")
    def _top_k(self) -> RolloutConfig:
        if self.top_k == 0:
            raise ValueError("rollout.top_k must be -1 (off) or >= 1")
        return self


class TrainerConfig(Component):
    """Training engine and the step schedule."""

    name: str = Field("toy", description="Train engine plugin name.")
    total_steps: int = Field(10, ge=1, description="Optimizer steps to run.")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one micro-batch (packing is token-balanced)."
    )
    checkpoint_every: int = Field(
        0, ge=0,
        description="Save a resumable checkpoint (run_dir/checkpoints) every N steps and at the end; 0 disables.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    export_final: bool = Field(
        True, description="At the end, write the weights as a Hugging Face checkpoint in run_dir/final_model "
        "(engines that have a Hugging Face model)."
    )
    lora: LoraSpec | None = Field(
        None, description="Train a LoRA adapter (peft) on frozen base weights instead of the full model; weight "
        "syncs after version 0 carry only the adapter. Its presence turns LoRA on (`trainer.lora: {}` for the "
        "defaults). Fields: `rank` (8), `alpha` (16), `dropout` (0.0, train steps only), `target_modules` (default "
        "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), `modules_to_save` (fully trained modules, "
        "none), `export` (what export_pretrained writes: merged or adapter). Trainers without `supports_lora` "
        "(megatron, toy) refuse it; docs/adapters/fsdp.md, \"LoRA\"."
    )


class StoreConfig(Component):
    """The streaming store deployment."""

    name: str = Field("inprocess", description="Store plugin name (inprocess, multiprocess, distributed, ray).")


class SamplerConfig(Component):
    """How the trainer's batches are picked from ready rows."""

    name: str = Field("group", description="Sampler plugin name (fifo, group, token_balanced, similar_length).")


class TransportConfig(Component):
    """How new weights reach the rollout engines."""

    name: str = Field("inprocess", description="Weight transport plugin name.")
    bucket_mb: float = Field(64.0, gt=0, description="Size of one weight bucket in MiB.")
    deadline_s: float = Field(300.0, gt=0, description="A transfer not finished by then fails with a reason.")


class AlgorithmConfig(Component):
    """Advantage estimator and policy loss."""

    name: str = Field("grpo", description="Algorithm plugin name.")


class RewardConfig(Component):
    """How samples are scored."""

    name: str = Field(description="Reward plugin name.")
    workers: int = Field(2, ge=1, description="Concurrent reward evaluations.")
    timeout_s: float = Field(60.0, gt=0, description="A reward not returned by then marks its sample failed.")
    inline: bool | None = Field(
        None, description="Score each completion in the rollout stage's write (the same store put as its tokens) "
        "instead of in a reward stage of its own, which costs four store calls per lease. null (auto): inline when "
        "the reward's class declares `local = True` (synchronous, cheap, no I/O: arithmetic, exact_match) and the "
        "run is single-turn; a remote pool, an async reward, pipeline.replace.reward and episodes keep the stage "
        "(with reward.workers and reward.timeout_s, which an inline reward does not use). true: inline any reward "
        "that can be (an error says why not); false: always the reward stage.")


class AsyncMode(str, enum.Enum):
    """How far rollout may run ahead of training."""

    SYNC = "sync"  #: k = 0, rollout and training time-share the devices: the on-policy baseline
    ONE_STEP = "one_step"  #: k = 1: the delayed parameter update of the AsyncFlow paper
    ASYNC = "async"  #: any k >= 1, partial rollout on


class StalePolicy(str, enum.Enum):
    """What happens to a row that would break the staleness bound."""

    REQUEUE = "requeue"  #: abort and re-queue it (partial rollout), keeping tokens when the engine can resume
    DROP = "drop"  #: drop it (counted in the metrics)


class StalenessBasis(str, enum.Enum):
    """Which version a row's age counts from (docs/simulation.md, "Tail policies")."""

    OLDEST_TOKEN = "oldest_token"  #: its oldest sampled token's: the exact bound
    REQUEST_START = "request_start"  #: the version its request started on, kept across resumes (AReaL's definition)


class StaleTail(str, enum.Enum):
    """What a request that falls outside the bound does (with stale_policy: requeue)."""

    RESTART = "restart"  #: starts again from the prompt on new weights; its group is re-queued when complete
    SETTLE_GROUP = "settle_group"  #: is written at once, stale, so the trainer re-queues its group now


_MODE_STALENESS = {AsyncMode.SYNC: 0, AsyncMode.ONE_STEP: 1}


class AsyncConfig(StrictModel):
    """Producer-consumer asynchrony and its staleness bound."""

    mode: AsyncMode = Field(AsyncMode.ONE_STEP, description="sync (k=0), one_step (k=1) or async (any k>=1).")
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="k: a row trains the update producing v+1 only if v - min_version <= k. "
        "Implied by mode for sync (0) and one_step (1); required for async.",
    )
    stale_policy: StalePolicy = Field(StalePolicy.REQUEUE, description="Fate of rows that fall outside the bound.")
    colocated: bool | None = Field(
        None,
        description="Rollout and training time-share the same devices (rollout engines sleep during each train "
        "step). Default: true for sync, false otherwise; sync with false is task-separated streaming at k=0.",
    )
    overprovision: float = Field(
        0.0, ge=0, le=4,
        description="Over-provisioned admission: start this fraction of a step's prompts more than the bound's "
        "(k+1) steps; the trainer takes the first complete groups (oldest first) and the rest wait for a later "
        "step, still under the bound (re-queued if they fall outside it). Needs max_staleness >= 1.",
    )
    staleness_basis: StalenessBasis = Field(
        StalenessBasis.OLDEST_TOKEN,
        description="What a row's age counts from: oldest_token (its oldest sampled token's version: exact) or "
        "request_start (the version its request started on, kept across resumes; needs "
        "algorithm.options.correction: decoupled).",
    )
    stale_tail: StaleTail = Field(
        StaleTail.RESTART,
        description="A request that falls outside the bound, with stale_policy requeue: restart (from the prompt; "
        "its group is re-queued once complete) or settle_group (written at once, stale, so its group is re-queued "
        "now and the row is not generated again for a group that cannot be trained).",
    )

    start_on_step_weights: bool = Field(
        False,
        description="A prompt starts only on weights that the step it is admitted for can use (that step - k), "
        "counting steps in admission order. Suits short, even completions, where every prompt is trained at its own "
        "step: otherwise the prompts admitted while a replica still loads the newest version start on the version "
        "before and are generated twice. Leave it off for long tails, where later prompts often finish first and "
        "train a step early on those older weights. Scheduling only: the bound is the same either way.",
    )

    @model_validator(mode="after")
    def _staleness_matches_mode(self) -> AsyncConfig:
        implied = _MODE_STALENESS.get(self.mode)
        if implied is not None:
            if self.max_staleness is not None and self.max_staleness != implied:
                raise ValueError(
                    f"mode {self.mode.value} means max_staleness={implied}, got {self.max_staleness}; "
                    "use mode: async for another bound"
                )
            object.__setattr__(self, "max_staleness", implied)
        elif self.max_staleness is None or self.max_staleness < 1:
            raise ValueError("mode async needs max_staleness >= 1 (use mode: sync for 0)")
        if self.colocated is None:
            object.__setattr__(self, "colocated", self.mode is AsyncMode.SYNC)
        elif self.colocated and self.mode is not AsyncMode.SYNC:
            raise ValueError("colocated: true time-shares devices, which leaves nothing to overlap; use mode: sync")
        if self.max_staleness == 0 and (self.overprovision > 0 or self.staleness_basis is not
                                        StalenessBasis.OLDEST_TOKEN):
            raise ValueError("overprovision and staleness_basis: request_start need max_staleness >= 1 (at k = 0 a "
                             "group carried to a later step is always stale); use mode: one_step or async")
        return self

    @property
    def k(self) -> int:
        """The staleness bound in force."""
        assert self.max_staleness is not None  # set by the validator
        return self.max_staleness


class CanaryConfig(StrictModel):
    """A check, off the hot path, that the rollout engines sample from the weights the trainer published."""

    every: int | None = Field(
        None, ge=0,
        description="Check every N steps: a live replica completes a few of the step's prompts right after loading "
        "the new version, and the trainer scores the same tokens at that version. 0 disables; default: 10 with a "
        "real model (model.path or model.hf_config), off otherwise.",
    )
    samples: int = Field(4, ge=1, description="Prompts completed per check (distinct prompts of the step's batch).")
    warn_above: float = Field(
        0.1, gt=0,
        description="Mean absolute difference per token between the engine's and the trainer's log-probs above "
        "which a check logs a warning (metric canary/mean_abs_dlogp). Engines computing in float32 agree to "
        "~1e-6; bfloat16 ones differ more.",
    )
    stop_above: float | None = Field(
        0.4, gt=0,
        description="Mean absolute log-prob difference above which the run stops with an error naming the engine "
        "(an engine that never loads weights measured 0.58 to 0.70 on the arithmetic example); null: only warn.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> CanaryConfig:
        if self.stop_above is not None and self.stop_above < self.warn_above:
            raise ValueError(f"canary.stop_above ({self.stop_above}) is below canary.warn_above ({self.warn_above})")
        return self

    def interval(self, real_model: bool, lora: bool = False) -> int:
        """Steps between checks in force (0: off); with LoRA every step by default (a dropped adapter sync shows
        only as a small log-prob shift, so each version is checked)."""
        if self.every is not None:
            return self.every
        if lora:
            return 1
        return 10 if real_model else 0


class PipelineConfig(StrictModel):
    """How the flow runtime runs the stages."""

    stages: list[Component] = Field(
        default_factory=list,
        description="Stage plugins to add (e.g. a filter or a second reward model); each runs on every sample "
        "before advantages are computed. See `asyncflow plugins --kind stage`.",
    )
    replace: dict[str, Component] = Field(
        default_factory=dict,
        description="Built-in stages to swap for a stage plugin, by role; today `reward` (the plugin must produce "
        "the `reward` column).",
    )

    lease_s: float = Field(
        86400.0, gt=0,
        description="Lease on rows a stage holds (rollout: until generated; train: until its step ends). Rows of a "
        "consumer that vanishes come back when it expires; keep it above the longest generation and train step "
        "(multi-turn and agent episodes renew it every turn: keep it above twice the longest turn).",
    )
    max_failure_rate: float = Field(
        0.2, ge=0, le=1, description="Stop the run when more than this fraction of processed rows failed."
    )
    reward_batch: int | None = Field(
        None, ge=1,
        description="Most rows a reward worker leases at once (it takes what is ready, up to this). Default: one "
        "step's rows (data.prompts_per_step x rollout.n), so a cheap reward costs a few store calls a step; set it "
        "lower to spread a slow reward's rows over more of reward.workers.",
    )
    logprob_batch: int = Field(64, ge=1, description="Rows a reference/proximal log-prob stage leases at once.")
    write_interval_s: float = Field(
        0.05, gt=0, description="Finished rollouts are written in batches at most this long after they finish."
    )
    fold_advantages: bool = Field(
        True,
        description="Compute group-scoped advantages (grpo with group or no std scaling, rloo) in the train stage's "
        "lease, with no advantage stage: four fewer store calls per lease of groups, same values. Applies when the "
        "algorithm declares advantage_scope 'group', the trainer's sampler leases whole groups (group) and no stage "
        "reads the advantages column; false keeps the advantage stage.",
    )


class LauncherConfig(Component):
    """Where the roles run (docs/launchers.md); the rest of the config is the same under every launcher."""

    name: str = Field(
        "local",
        description="Launcher plugin name (local: one process; ray: rollout replicas, trainer and reward workers as "
        "Ray actors, the store on its ray deployment; options in docs/launchers.md).",
    )


class EnvironmentConfig(Component):
    """Multi-turn episodes: the environment the policy acts in (absent: single-turn rollouts)."""

    name: str = Field(description="Environment plugin name (see `asyncflow plugins --kind environment`).")
    max_turns: int = Field(4, ge=1, description="Most policy turns per episode; an episode not done by then is "
                           "cut there, with the reason (max_turns) recorded.")
    step_timeout_s: float = Field(
        30.0, gt=0, description="A reset or step not returned by then ends its episode as a recorded failure."
    )
    max_episode_tokens: int | None = Field(
        None, ge=1,
        description="Most tokens per episode (prompt, turns and observations); an episode that would grow past it "
        "is cut there, with the reason (max_episode_tokens) recorded. Default: no limit of its own (the model's "
        "context still bounds each turn's request).",
    )
    workers: int | None = Field(
        None, ge=1,
        description="Episodes whose environments are open at once (per rollout process). Default: "
        "rollout.replicas x rollout.max_inflight, so every decode slot can have an episode while others wait on "
        "their tools (fewer starves decoding when tools are slow: docs/performance.md, slow tools).")
    processes: int | None = Field(
        None, ge=0,
        description="0: environments run in the event loop; N: in a pool of N worker processes, each environment on "
        "a thread of its own there, so a blocking tool never stalls decoding and every open episode's blocking wait "
        "runs at once (CPU-bound Python tools: N at once). Default: 0, or 2 when the environment declares "
        "features.blocking.",
    )


class AgentConfig(StrictModel):
    """Captured episodes: a black-box agent on the capture endpoint (docs/agents.md); excludes `environment`."""

    entry: str = Field(description="The agent coroutine, `package.module:function`, called per prompt row as "
                       "`await agent(record, base_url=..., api_key=..., **options)`.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments given to every agent call.")
    timeout_s: float = Field(
        120.0, gt=0, description="Longest the agent may run between two of its model calls (and before the first, "
        "after the last); past it the episode fails with that reason.")
    max_calls: int = Field(8, ge=1, description="Most model calls per episode; the next one is refused and the "
                           "episode written there (truncated).")


#: metrics an ``eval`` section may ask for (``pass@N`` for any N up to ``samples_per_prompt`` too)
EVAL_METRICS = ("pass@1", "pass@k", "mean_reward", "mean_length", "format_rate")


class EvalDatasetConfig(Component):
    """One held-out prompt set: a dataset plugin and its options, as in the ``data`` section."""

    name: str = Field("jsonl", description="Dataset plugin name (the same plugins and options as `data`).")
    label: str | None = Field(
        None, description="Name of this set in metrics (eval/<label>/pass@1); default: the file's stem.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N prompts of the set.")


class EvalConfig(StrictModel):
    """Validation during training, each evaluation pinned to one weight version (docs/data-and-rewards.md)."""

    datasets: list[EvalDatasetConfig] = Field(
        min_length=1, description="Held-out prompt sets; their rows never enter training (nor the training store).")
    every_steps: int = Field(
        20, ge=0, description="Evaluate the weights of every N-th version (after N, 2N, ... steps); 0: only "
        "`at_start`/`at_end`.")
    samples_per_prompt: int = Field(1, ge=1, description="Completions per eval prompt (k of pass@k).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of eval completions (a small value such as 0.01 is near-greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass of eval completions.")
    max_new_tokens: int | None = Field(None, ge=1, description="Cap on eval completion tokens; default: rollout's.")
    metrics: list[str] = Field(
        default_factory=lambda: ["pass@1", "pass@k", "mean_reward", "mean_length", "format_rate"],
        description="What to report: pass@1, pass@k (k = samples_per_prompt; or pass@N for N <= it, unbiased "
        "estimator), mean_reward, mean_length (tokens), format_rate (share of completions whose reward reports "
        "answer_found=1; math_verify does).",
    )
    pass_threshold: float = Field(1.0, description="A completion passes when its reward is at least this.")
    priority: float = Field(
        1.0, gt=0, le=1,
        description="Share of a rollout replica's slots (rollout.max_inflight) eval requests may take while "
        "training generates beside them; the rest stays with training. The default, every free slot, ends a "
        "round soonest: the replica's next weights wait until its share of the round is done, so a smaller share "
        "pins it to an old version longer (measured: +0 to +9 % wall at 1.0 against +9 to +10 % at 0.25, "
        "docs/performance.md).",
    )
    at_start: bool = Field(False, description="Also evaluate version 0 (the initial weights).")
    at_end: bool = Field(True, description="Also evaluate the last version when it is not a multiple of every_steps.")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        for m in value:
            if m not in EVAL_METRICS and not re.fullmatch(r"pass@[1-9][0-9]*", m):
                raise ValueError(f"unknown eval metric {m!r}; use {', '.join(EVAL_METRICS)} or pass@N")
        return value

    @model_validator(mode="after")
    def _k_fits(self) -> EvalConfig:
        for m in self.metrics:
            if m.startswith("pass@") and m != "pass@k" and int(m[5:]) > self.samples_per_prompt:
                raise ValueError(f"eval metric {m} needs at least {m[5:]} samples per prompt; raise "
                                 f"eval.samples_per_prompt (now {self.samples_per_prompt}) or lower N")
        return self


class LoggingConfig(StrictModel):
    """Where metrics and traces go."""

    run_dir: str = Field("runs/{name}", description="Directory for metrics, traces and checkpoints; {name} is the run name.")
    level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="Log level.")
    tensorboard: bool = Field(False, description="Also write TensorBoard event files (needs tensorboard).")
    wandb_project: str | None = Field(None, description="Also log to this W&B project (needs wandb).")


class RunConfig(StrictModel):
    """A whole run: every section of an asyncflow YAML file."""

    name: str = Field("asyncflow-run", description="Run name (used in run_dir and logs).")
    seed: int = Field(0, description="Seed for data order, sampling and initial weights.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt dataset.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Inference engines.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Training engine.")
    store: StoreConfig = Field(default_factory=StoreConfig, description="Streaming store.")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="Trainer batch sampler.")
    weight_transport: TransportConfig = Field(default_factory=TransportConfig, description="Weight transport.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm.")
    reward: RewardConfig = Field(description="Reward.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", description="Asynchrony and staleness.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Flow runtime knobs.")
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="Weights canary (rollout vs trainer).")
    launcher: LauncherConfig = Field(default_factory=LauncherConfig, description="Launcher.")
    eval: EvalConfig | None = Field(None, description="Validation pinned to weight versions (null: none).")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and traces.")
    environment: EnvironmentConfig | None = Field(
        None, description="Multi-turn environment (docs/agents.md); absent: one completion per sample."
    )
    agent: AgentConfig | None = Field(
        None, description="Captured agent episodes (docs/agents.md); excludes `environment`."
    )


#: Component sections and the plugin kind each names.
COMPONENT_SECTIONS: dict[str, str] = {
    "data": "dataset",
    "rollout": "rollout_engine",
    "trainer": "train_engine",
    "store": "store",
    "sampler": "sampler",
    "weight_transport": "weight_transport",
    "algorithm": "algorithm",
    "reward": "reward",
    "launcher": "launcher",
}
