"""What the plugin declares: its options (validated from a run config's ``rollout.options``) and its features.

Kept free of heavy imports: the plugin manager reads both while listing plugins.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces import RolloutFeatures

#: What this engine honours beyond the core contract. A False flag is a promise
#: too: the method raises UnsupportedFeatureError, and the spec suite checks it.
FEATURES = RolloutFeatures(
    supports_abort=True,  # abort() ends requests; their partial tokens come out of generate()
    supports_resume_prefix=True,  # a request's prefix (earlier aborted attempt) is continued
    supports_pause_keep=False,  # pause(KEEP) raises: this engine cannot hold requests mid-flight
    supports_pause_abort=True,  # pause(ABORT) aborts in-flight requests, then holds new ones
    supports_inflight_weight_update=False,  # weights change between decoding steps only
    supports_sleep=False,  # sleep()/wake_up() raise: nothing to offload on a CPU
    weight_transports=("inprocess",),
)


class MyEngineConfig(BaseModel):
    """Options of the ``myengine`` rollout engine (``rollout.options`` in a run config)."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(32, ge=2, description="Vocabulary size of the model (token ids are 0..vocab_size-1).")
    hidden_size: int = Field(16, ge=1, description="Width of the GRU and its embeddings.")
    seed: int = Field(0, description="Seed of the random version-0 weights.")
    sampling_seed: int = Field(1, description="Seed of the engine's sampling generator (requests without a seed).")
    device: str = Field("cpu", description="torch device the model runs on, e.g. cpu or cuda:0.")
