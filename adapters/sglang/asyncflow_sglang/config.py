"""Options of the ``sglang`` rollout engine (validated by the plugin manager from the config's ``options``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import RolloutFeatures

#: The SGLang releases this adapter was written against (read from their source; both ends included).
#: ``start()`` refuses a server outside it (``allow_unsupported_version`` overrides).
SUPPORTED_SGLANG = ((0, 5, 20), (0, 5, 23))
#: Where SGLang is installed from, for the messages that name the supported range.
SGLANG_INSTALL = 'pip install "sglang>=0.5.20,<0.5.24"'
#: From this release on, weight updates must run between /begin_weight_update and /end_weight_update.
UPDATE_SESSION_SINCE = (0, 5, 21)

#: What the registration declares (``asyncflow plugins`` shows it). An engine
#: reports ``supports_sleep`` only when its server runs with the memory saver
#: (``memory_saver: true``), ``supports_pause_keep`` unless ``pause_keep: false``,
#: and ``supports_inflight_weight_update`` only with ``keep_mode: retract``.
DECLARED_FEATURES = RolloutFeatures(
    supports_abort=True,
    supports_resume_prefix=True,
    supports_pause_keep=True,
    supports_pause_abort=True,
    # requests held by pause(keep) continue on the new weights; the answer's meta_info.weight_versions spans say
    # which weights sampled which token. Only with keep_mode retract, whose KV cache is recomputed on resume
    # (in_place keeps the old weights' cache, and SGLang refuses to flush it while requests are held).
    supports_inflight_weight_update=True,
    supports_sleep=True,
    weight_transports=("inprocess",),
)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LaunchConfig(BaseModel):
    """How the engine starts its own SGLang server (``python -m sglang.launch_server``)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str | None = Field(
        None, description="--model-path: a local checkpoint directory; default: the run's model.path."
    )
    port: int = Field(0, ge=0, le=65535, description="--port; 0 picks a free port on 127.0.0.1.")
    tp_size: int = Field(1, ge=1, description="--tp-size: tensor-parallel GPUs of the server.")
    dp_size: int = Field(
        1, ge=1, description="--dp-size: must be 1 (SGLang's weight-update group takes one data-parallel "
        "replica); run one engine replica per server instead."
    )
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="--mem-fraction-static: GPU memory share for weights + KV cache."
    )
    dtype: str | None = Field(
        None, description="--dtype (auto, bfloat16, float16 ...); default: the run's model.dtype."
    )
    random_seed: int | None = Field(None, description="--random-seed of the server's sampler.")
    deterministic_inference: bool = Field(
        False,
        description="--enable-deterministic-inference: SGLang honours per-request sampling seeds only in this mode "
        "(it also switches to its PyTorch sampler); without it seeded requests are refused.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More launch_server arguments, passed as given (e.g. ['--attention-backend', 'fa3']).",
    )
    command: list[str] | None = Field(
        None,
        description="The program to run instead of [python, -m, sglang.launch_server] (the options above are "
        "appended as launch_server arguments); tests point it at the protocol fake.",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for the server's /ready.")
    log_path: str | None = Field(None, description="File the server's stdout/stderr go to; default: a temp file.")

    @field_validator("dp_size", mode="before")
    @classmethod
    def _one_dp_replica(cls, value: object) -> object:
        if isinstance(value, int) and value > 1:
            raise ValueError(
                f"dp_size {value}: SGLang's /init_weights_update_group asserts dp_size == 1 and numbers the group's "
                "ranks rank_offset + tp_rank, so weights cannot reach a data-parallel server; run one rollout "
                "replica (one server) per data-parallel copy instead (rollout.replicas)"
            )
        return value

    @model_validator(mode="after")
    def _float32_needs_a_backend(self) -> LaunchConfig:
        if self.dtype in ("float32", "float") and "--attention-backend" not in self.extra_args:
            raise ValueError(
                "dtype float32: SGLang's default attention backends (FlashInfer, FA3) run half precision only; "
                "use dtype bfloat16, or name a backend that takes float32, e.g. "
                "extra_args: ['--attention-backend', 'triton']"
            )
        return self


class WeightSyncConfig(BaseModel):
    """How ``update_weights`` moves tensors into the server."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["distributed", "tensor"] = Field(
        "distributed",
        description="distributed: this process joins a torch.distributed group with the server's ranks "
        "(/init_weights_update_group) and broadcasts every tensor (/update_weights_from_distributed). "
        "tensor: colocated on the same GPUs, tensors go by CUDA IPC handle (/update_weights_from_tensor).",
    )
    backend: Literal["nccl", "gloo"] = Field(
        "nccl", description="torch.distributed backend of the weight group: nccl for CUDA buckets, gloo for CPU."
    )
    master_address: str = Field(
        "127.0.0.1",
        description="Address this process listens on for the group's rendezvous (the server's ranks connect to "
        "it); loopback unless allow_remote.",
    )
    allow_remote: bool = Field(
        False, description="Allow a non-loopback master_address (a server on another host): this process then "
        "listens on that address.",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where tensors are sent from (buckets are moved there): auto (cuda for nccl, cpu for gloo), cpu, "
        "cuda, cuda:N; tensor mode needs a cuda device.",
    )
    group_timeout_s: float = Field(600.0, gt=0, description="Deadline of joining the group and of each broadcast.")

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> WeightSyncConfig:
        if not is_loopback(self.master_address) and not self.allow_remote:
            raise ValueError(
                f"master_address {self.master_address!r} is not a loopback address: this process would listen there "
                "for the server's ranks; set weight_sync.allow_remote: true if the server runs on another host"
            )
        return self
    drain_timeout_s: float = Field(
        600.0, gt=0, description="How long an update waits for in-flight requests to finish (the safe point)."
    )


class SGLangRolloutConfig(BaseModel):
    """Options of the ``sglang`` rollout engine: connect to ``url``, or start a server from ``launch``."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        None, description="Base URL of a running SGLang server (http://host:port); leave unset to launch one."
    )
    launch: LaunchConfig | None = Field(None, description="Start and own a server (127.0.0.1 only) instead of `url`.")
    model: ModelConfig | None = Field(
        None, description="The policy; filled from the run's `model` section (launch uses model.path and model.dtype)."
    )
    api_key: str | None = Field(None, description="Bearer token, when the server was started with --api-key.")
    admin_api_key: str | None = Field(
        None,
        description="Bearer token for SGLang's admin routes (abort, pause, weights, memory, flush), when the server "
        "was started with --admin-api-key (launch passes it); such a server takes only this key on those routes.",
    )
    world_size: int | None = Field(
        None, ge=1, description="Ranks of the server (its tp_size); default: what the server's /server_info reports. "
        "Set it only to have start() check it."
    )
    request_timeout_s: float = Field(
        3600.0, gt=0, description="Deadline of one /generate call (a whole completion); past it the request errors."
    )
    control_timeout_s: float = Field(60.0, gt=0, description="Deadline of control calls (abort, pause, flush, health).")
    connect_timeout_s: float = Field(10.0, gt=0, description="Deadline of opening a connection to the server.")
    max_connections: int = Field(1024, ge=1, description="Most concurrent HTTP connections (= requests in flight).")
    keepalive_s: float = Field(
        2.0,
        gt=0,
        description="Seconds an idle connection is kept for reuse. Keep it below the server's keep-alive timeout "
        "(SGLang: SGLANG_TIMEOUT_KEEP_ALIVE, 5 s), or a request can go out on a connection the server is closing "
        "and be lost.",
    )
    abort_retry_s: float = Field(
        0.05,
        gt=0,
        description="An aborted request whose answer has not come back after this may have been unknown to the "
        "server when its abort arrived (SGLang drops such aborts and forwards one abort per request): when every "
        "request of this engine on the server is aborted, it then sends abort_all (again after doubling delays, up "
        "to 1 s) until the answers are back.",
    )
    pause_keep: bool = Field(
        True, description="Offer pause(keep) (/pause_generation mode in_place or retract; SGLang >= 0.5.6)."
    )
    keep_mode: Literal["in_place", "retract"] = Field(
        "in_place",
        description="What pause(keep) asks for: in_place keeps requests and their KV cache; retract moves them "
        "back to the waiting queue (KV cache recomputed on resume).",
    )
    memory_saver: bool = Field(
        False,
        description="The server runs with --enable-memory-saver (launch adds it): offer sleep()/wake_up() through "
        "/release_memory_occupation and /resume_memory_occupation.",
    )
    truncated_logprobs: Literal["renormalise", "refuse", "server"] = Field(
        "renormalise",
        description="Requests with top_k > 0 or top_p < 1 (SGLang's output_token_logprobs are not renormalised "
        "after truncation). renormalise: top-k-only requests ask for return_sampling_mask and return SGLang's "
        "renormalised selected log-probs (asyncflow's convention); top_p < 1 is refused (SGLang cuts top-p on the "
        "untruncated distribution, asyncflow after top-k). refuse: every truncated request fails with the reason. "
        "server: return SGLang's unrenormalised values.",
    )
    eos_token_ids: list[int] = Field(
        default_factory=list,
        description="Tokens that end a completion besides each request's stop_token_ids (the server also stops at "
        "the model's own EOS); used to tell whether a resumed prefix is already complete.",
    )
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="How weights reach the server.")
    allow_unsupported_version: bool = Field(
        False,
        description="Use a server whose /server_info version is outside the supported range (0.5.20 to 0.5.23) "
        "anyway; routes and semantics were read for that range only.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https:// (e.g. http://127.0.0.1:30000)")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _one_server(self) -> SGLangRolloutConfig:
        if (self.url is None) == (self.launch is None):
            raise ValueError(
                "set exactly one of url (a running server, e.g. url: http://127.0.0.1:30000) or launch "
                "(start one, e.g. launch: {model_path: /ckpt/qwen})"
            )
        return self

    def features(self) -> RolloutFeatures:
        """The capabilities of an engine built from these options."""
        return DECLARED_FEATURES.model_copy(update={
            "supports_pause_keep": self.pause_keep,
            "supports_sleep": self.memory_saver,
            "supports_inflight_weight_update": self.pause_keep and self.keep_mode == "retract",
        })


def parse_version(text: str) -> tuple[int, ...] | None:
    """``"0.5.6.post2"`` -> ``(0, 5, 6)``; ``None`` when it does not start with numbers."""
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts) if parts else None


def is_loopback(host: str) -> bool:
    return host in _LOOPBACK


def version_supported(version: tuple[int, ...]) -> bool:
    """Whether an SGLang version (a.b.c, any suffix dropped) lies in :data:`SUPPORTED_SGLANG`."""
    low, high = SUPPORTED_SGLANG
    return low <= tuple(version[:3]) <= high


def show_version(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)
