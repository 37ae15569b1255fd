"""Options of the ``sglang`` rollout engine (validated by the plugin manager from the config's ``options``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import RolloutFeatures

#: What the registration declares (``asyncflow plugins`` shows it). An engine
#: reports ``supports_sleep`` only when its server runs with the memory saver
#: (``memory_saver: true``), and ``supports_pause_keep`` unless ``pause_keep: false``.
DECLARED_FEATURES = RolloutFeatures(
    supports_abort=True,
    supports_resume_prefix=True,
    supports_pause_keep=True,
    supports_pause_abort=True,
    # held requests would continue on new weights, but a non-streaming answer does not say which of its
    # tokens came before the update, so per-token versions could not be told: the runtime pauses with
    # ABORT and resumes the requests with their tokens as a prefix instead (exact versions)
    supports_inflight_weight_update=False,
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
    dp_size: int = Field(1, ge=1, description="--dp-size: data-parallel replicas inside the server.")
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="--mem-fraction-static: GPU memory share for weights + KV cache."
    )
    dtype: str | None = Field(
        None, description="--dtype (auto, bfloat16, float16 ...); default: the run's model.dtype."
    )
    random_seed: int | None = Field(None, description="--random-seed of the server's sampler.")
    extra_args: list[str] = Field(
        default_factory=list,
        description="More launch_server arguments, passed as given (e.g. ['--attention-backend', 'fa3']).",
    )
    command: list[str] | None = Field(
        None,
        description="The program to run instead of [python, -m, sglang.launch_server] (the options above are "
        "appended as launch_server arguments); tests point it at the protocol fake.",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for the server's /health.")
    log_path: str | None = Field(None, description="File the server's stdout/stderr go to; default: a temp file.")


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
    world_size: int | None = Field(
        None, ge=1, description="Ranks of the server (tp_size x dp_size); default: launch's, or 1 with `url`."
    )
    request_timeout_s: float = Field(
        3600.0, gt=0, description="Deadline of one /generate call (a whole completion); past it the request errors."
    )
    control_timeout_s: float = Field(60.0, gt=0, description="Deadline of control calls (abort, pause, flush, health).")
    connect_timeout_s: float = Field(10.0, gt=0, description="Deadline of opening a connection to the server.")
    max_connections: int = Field(1024, ge=1, description="Most concurrent HTTP connections (= requests in flight).")
    abort_retry_s: float = Field(
        0.05,
        gt=0,
        description="An aborted request whose answer has not come back is aborted again after this (then doubling, "
        "up to 1 s): an abort can reach the server before the request itself.",
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
    truncated_logprobs: Literal["refuse", "server"] = Field(
        "refuse",
        description="Requests with top_p < 1 or top_k > 0: SGLang's log-probs are not renormalised after the "
        "truncation, so they differ from asyncflow's convention. refuse: such a request fails with the reason; "
        "server: return SGLang's values anyway.",
    )
    eos_token_ids: list[int] = Field(
        default_factory=list,
        description="Tokens that end a completion besides each request's stop_token_ids (the server also stops at "
        "the model's own EOS); used to tell whether a resumed prefix is already complete.",
    )
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="How weights reach the server.")
    min_server_version: str = Field(
        "0.4.10", description="Refuse servers whose /get_server_info version is older (parsed as numbers a.b.c)."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https:// (e.g. http://127.0.0.1:30000)")
        return value.rstrip("/")

    @field_validator("min_server_version")
    @classmethod
    def _version(cls, value: str) -> str:
        if parse_version(value) is None:
            raise ValueError(f"min_server_version must look like 0.4.10, got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_server(self) -> SGLangRolloutConfig:
        if (self.url is None) == (self.launch is None):
            raise ValueError(
                "set exactly one of url (a running server, e.g. url: http://127.0.0.1:30000) or launch "
                "(start one, e.g. launch: {model_path: /ckpt/qwen})"
            )
        return self

    @property
    def server_world_size(self) -> int:
        """Ranks the server has: they all join the weight group after this process (rank 0)."""
        if self.world_size is not None:
            return self.world_size
        return self.launch.tp_size * self.launch.dp_size if self.launch is not None else 1

    def features(self) -> RolloutFeatures:
        """The capabilities of an engine built from these options."""
        return DECLARED_FEATURES.model_copy(
            update={"supports_pause_keep": self.pause_keep, "supports_sleep": self.memory_saver}
        )


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
