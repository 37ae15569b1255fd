"""Capability declarations: what optional parts of a contract a backend honours.

Each backend exposes a ``features`` property returning one of these pydantic
models. A flag that is ``False`` means the corresponding method raises
:class:`~asyncflow_core.errors.UnsupportedFeatureError`; the conformance suite
tests the feature when the flag is on and that documented error when it is off.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


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
    supports_restart: bool = Field(
        False, description="restart() replaces a dead engine with a fresh, started one (a launcher's remote replica); "
        "off: a replica that dies is lost for the rest of the run."
    )
    supports_adapter_updates: bool = Field(
        False,
        description="configure_adapter() is accepted and update_weights() applies adapter-only (LoRA) updates: "
        "a partial update carrying only the adapter's tensors, under peft's state-dict names.",
    )
    weight_transports: tuple[str, ...] = Field(
        ("inprocess",), description="Names of the weight transports this engine can receive from."
    )


class TrainFeatures(Features):
    supports_values: bool = Field(False, description="compute_logprobs(..., values=True) returns a value head's estimates.")
    supports_checkpoint: bool = Field(True, description="save()/load() round-trip model and optimizer state.")
    supports_hf_export: bool = Field(
        False, description="export_pretrained() writes a Hugging Face save_pretrained directory."
    )
    supports_lora: bool = Field(
        False, description="trainer.lora trains a peft LoRA adapter on frozen base weights; export_weights then sends "
        "only the adapter's tensors after version 0 (asyncflow_core.types.adapter)."
    )
    weight_transports: tuple[str, ...] = Field(
        ("inprocess",), description="Names of the weight transports this engine can publish through."
    )


class StoreFeatures(Features):
    deployment: str = Field("inprocess", description="Where rows live: inprocess, multiprocess, distributed or ray.")
    zero_copy_get: bool = Field(False, description="get() returns views of stored tensors, not copies.")
    supports_checkpoint: bool = Field(True, description="state_dict()/load_state_dict() save and restore progress.")
    supports_lease_renewal: bool = Field(
        True, description="renew(meta) pushes a live lease's deadline to now + lease_s, so a consumer that holds rows "
        "longer than one lease (a long agentic episode) keeps them; off: renew raises UnsupportedFeatureError and "
        "such work must ask get_meta for a lease_s longer than it ever runs."
    )


class TransportFeatures(Features):
    cross_process: bool = Field(False, description="Sender and receiver may live in different processes.")
    cross_host: bool = Field(False, description="Sender and receiver may live on different hosts.")
    devices: tuple[str, ...] = Field(("cpu",), description="Device types the buckets may live on.")


class RewardFeatures(Features):
    """What a reward offers beyond ``score`` (read with :func:`reward_features`)."""

    needs_text: bool = Field(
        True, description="score() reads decoded text; off: the reward stage skips decoding and passes empty text "
        "and token ids."
    )
    supports_score_many: bool = Field(
        False, description="score_many(samples, timeout_s) scores a batch in one call, (True, value) or (False, why) "
        "per sample; off: the reward stage calls score() once per sample."
    )
    local: bool = Field(
        False, description="score() is synchronous, cheap and does no I/O: a single-turn run scores it inline in the "
        "rollout stage's write, with no reward stage of its own (reward.inline)."
    )
    extras: tuple[str, ...] = Field(
        (), description="Keys the reward returns beside 'reward' in its mapping (e.g. 'correct'): each becomes a "
        "per-row float32 store column `reward_extra/<key>` (NaN where a sample lacks it) that the trainer receives and "
        "each step's record averages as `reward/<key>`. Undeclared keys are reported once and not recorded."
    )

    @field_validator("extras")
    @classmethod
    def _extra_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for key in keys:
            if not isinstance(key, str) or not key or key == "reward" or "/" in key:
                raise ValueError(f"extras: {key!r} is not a usable key; name each extra value (not 'reward', no '/')")
        if len(set(keys)) != len(keys):
            raise ValueError(f"extras: {list(keys)} names a key twice")
        return keys


class AlgorithmFeatures(Features):
    """How an algorithm's advantages must be computed (read with :func:`algorithm_features`)."""

    advantage_scope: str = Field(
        "group", pattern="^(group|step)$",
        description="group: compute_advantages needs whole prompt groups, and a group's advantages read only its "
        "own rows (the train stage computes them in its lease of whole groups, or the advantage stage does: "
        "pipeline.fold_advantages); step: it normalises over the whole optimizer step, so the train stage calls it "
        "on the step's rows."
    )
    honours_loss_mask: bool = Field(
        False, description="Its loss skips tokens with loss_mask 0 (observations, tool output): required for "
        "multi-turn and captured episodes, which a run refuses otherwise (they would train on tool output)."
    )


def reward_features(reward: object) -> RewardFeatures:
    """The reward's :class:`RewardFeatures`: its ``features`` when it declares them, else read from what it defines.

    A reward without a ``features`` property declares ``needs_text``,
    ``local`` and ``extras`` as class attributes (defaults True, False and
    ``()``) and batch scoring by defining a callable ``score_many``; this is
    the one place those declarations are read.
    """
    declared = getattr(reward, "features", None)
    if isinstance(declared, RewardFeatures):
        return declared
    try:
        many = callable(getattr(reward, "score_many", None))
    except AttributeError:  # a property that refuses (the reward scores one at a time in this configuration)
        many = False
    try:
        return RewardFeatures(needs_text=bool(getattr(reward, "needs_text", True)), supports_score_many=many,
                              local=getattr(type(reward), "local", False) is True,
                              extras=tuple(getattr(reward, "extras", ())))
    except ValidationError as exc:
        why = "; ".join(e["msg"] for e in exc.errors())
        raise ValueError(f"{type(reward).__name__}.extras: {why}") from None


def algorithm_features(algorithm: object) -> AlgorithmFeatures:
    """The algorithm's :class:`AlgorithmFeatures`: its ``features`` when declared, else its ``advantage_scope``."""
    declared = getattr(algorithm, "features", None)
    if isinstance(declared, AlgorithmFeatures):
        return declared
    scope = getattr(algorithm, "advantage_scope", "group")
    return AlgorithmFeatures(advantage_scope=str(getattr(scope, "value", scope)),
                             honours_loss_mask=bool(getattr(algorithm, "honours_loss_mask", False)))
