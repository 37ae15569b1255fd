"""Capability declarations: what optional parts of a contract a backend honours.

Each backend exposes a ``features`` property returning one of these pydantic
models. A flag that is ``False`` means the corresponding method raises
:class:`~asyncflow_core.errors.UnsupportedFeatureError`; the conformance suite
tests the feature when the flag is on and that documented error when it is off.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Features(BaseModel):
    """Base of every capability model: frozen, strict about unknown flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RolloutFeatures(Features):
    supports_abort: bool = Field(True, description="abort() ends in-flight requests with finish reason 'abort' and their partial tokens.")
    supports_resume_prefix: bool = Field(
        False, description="Requests carrying a prefix from an aborted attempt are continued, not restarted."
    )
    supports_pause_keep: bool = Field(
        False, description="pause(mode='keep') holds in-flight requests (and their KV cache) until resume()."
    )
    supports_pause_abort: bool = Field(True, description="pause(mode='abort') aborts in-flight requests, then holds new ones.")
    supports_inflight_weight_update: bool = Field(
        False, description="update_weights() may be called while paused with requests held (they continue on the new version)."
    )
    supports_sleep: bool = Field(False, description="sleep()/wake_up() release and restore device memory (colocated mode).")
    weight_transports: tuple[str, ...] = Field(
        ("inprocess",), description="Names of the weight transports this engine can receive from."
    )


class TrainFeatures(Features):
    supports_values: bool = Field(False, description="compute_logprobs(..., values=True) returns a value head's estimates.")
    supports_checkpoint: bool = Field(True, description="save()/load() round-trip model and optimizer state.")
    supports_hf_export: bool = Field(
        False, description="export_pretrained() writes a Hugging Face save_pretrained directory."
    )
    weight_transports: tuple[str, ...] = Field(
        ("inprocess",), description="Names of the weight transports this engine can publish through."
    )


class StoreFeatures(Features):
    deployment: str = Field("inprocess", description="Where rows live: inprocess, multiprocess, distributed or ray.")
    zero_copy_get: bool = Field(False, description="get() returns views of stored tensors, not copies.")
    supports_checkpoint: bool = Field(True, description="state_dict()/load_state_dict() save and restore progress.")


class TransportFeatures(Features):
    cross_process: bool = Field(False, description="Sender and receiver may live in different processes.")
    cross_host: bool = Field(False, description="Sender and receiver may live on different hosts.")
    devices: tuple[str, ...] = Field(("cpu",), description="Device types the buckets may live on.")
