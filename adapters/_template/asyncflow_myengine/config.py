"""What the plugin declares: its options (validated from a run config's ``rollout.options``) and its features.

Kept free of heavy imports: the plugin manager reads both while listing plugins.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.interfaces import RolloutFeatures

#: What this engine honours beyond the core contract. A False flag is a promise
#: too: the method raises UnsupportedFeatureError, and the spec suite checks it.
FEATURES = RolloutFeatures(
    supports_abort=True,  # abort() ends requests; their partial tokens come out of generate()
    supports_resume_prefix=True,  # a request's prefix (earlier aborted attempt) is continued
    supports_pause_keep=True,  # pause(KEEP) stops decoding and keeps every request's cache until resume()
    supports_pause_abort=True,  # pause(ABORT) aborts in-flight requests, then holds new ones
    supports_inflight_weight_update=True,  # an update while paused with KEEP applies to the held requests
    supports_sleep=False,  # sleep()/wake_up() raise: nothing to offload on a CPU
    weight_transports=("inprocess",),
)


class MyEngineConfig(BaseModel):
    """Options of the ``myengine`` rollout engine (``rollout.options`` in a run config)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig | None = Field(
        None,
        description="The policy (a local checkpoint `path` or an `hf_config` to build, and its dtype); filled from "
        "the run's `model` section when unset, so the engine serves the model the trainer trains.",
    )
    init_seed: int = Field(
        0, description="Seed of the random initial weights of a `model.hf_config` (use the trainer's seed)."
    )
    sampling_seed: int = Field(1, description="Seed of the engine's sampling generator (requests without a seed).")
    device: str = Field("cpu", description="torch device the model runs on, e.g. cpu or cuda:0.")
