"""Options of the ``ray`` launcher (``launcher.options``); importing this module does not import Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RayLauncherConfig(BaseModel):
    """``launcher.options`` of ``launcher.name: ray``: the cluster, resources per role, placement, fault handling."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None,
        description="Ray cluster to join (e.g. 'auto', '10.0.0.5:6379', 'ray://head:10001'); unset: start a "
        "single-host Ray here bound to 127.0.0.1 only, and stop it at the end.",
    )
    namespace: str | None = Field(
        None, description="Ray namespace of the run's named actors (default: a fresh one per run)."
    )
    num_cpus: int | None = Field(
        None, ge=1,
        description="Logical CPUs of the Ray started here (default: this machine's count or the roles' reservations, "
        "whichever is more); ignored with address.",
    )
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of the Ray started here (default: what Ray detects); ignored with address."
    )
    rollout_cpus: float = Field(1.0, ge=0, description="CPUs reserved per rollout replica actor.")
    rollout_gpus: float = Field(0.0, ge=0, description="GPUs reserved per rollout replica actor.")
    trainer_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved for the trainer actor (and as much again for a reference model)."
    )
    trainer_gpus: float = Field(
        0.0, ge=0,
        description="GPUs reserved for the trainer actor. With trainer_ranks: processes, a trainer that spawns N ranks "
        "needs N here on GPU; with rank actors the ranks hold the GPUs (trainer_rank_gpus) and this stays 0.",
    )
    trainer_ranks: Literal["actors", "processes"] = Field(
        "actors",
        description="Where a trainer's ranks run when its engine has world_size > 1 (fsdp, megatron): actors: one "
        "Ray actor per rank, placed in the trainer's placement group (torch.distributed inside the actors, one node); "
        "processes: child processes of the trainer actor.",
    )
    trainer_rank_cpus: float = Field(
        1.0, ge=0,
        description="CPUs reserved per rank actor (trainer_ranks: actors), for the trainer and the reference model.",
    )
    trainer_rank_gpus: int = Field(
        0, ge=0, le=1,
        description="GPUs per rank actor (trainer_ranks: actors): 1 runs the ranks on CUDA with NCCL, one GPU each; "
        "0 runs them on CPU with gloo.",
    )
    weights: Literal["object_store", "dist", "driver"] = Field(
        "object_store",
        description="How each weight version goes from the trainer actor to the rollout actors: object_store: the "
        "trainer actor puts the buckets and each rollout actor fetches them (works across nodes); dist: a "
        "torch.distributed group of the trainer and rollout actors on 127.0.0.1 (gloo; NCCL when both have GPUs; one "
        "node only); driver: every bucket through the driver and the configured weight_transport.",
    )
    reward_workers: int = Field(
        1, ge=1,
        description="Reward worker actors; reward batches go to the least busy one. A reward whose model is a role of "
        "its own (`model`, or `combined` with a `model` term) starts none: it runs in the driver and its replicas are "
        "actors placed by reward.options.placement.")
    reward_cpus: float = Field(0.5, ge=0, description="CPUs reserved per reward worker actor.")
    placement: Literal["separate", "colocated", "none"] = Field(
        "separate",
        description="separate: one placement group per role pool (rollout, trainer, reward), each packed; "
        "colocated: one STRICT_PACK group holding every role (one node); none: no placement groups.",
    )
    store: Literal["ray", "as_configured"] = Field(
        "ray",
        description="ray: an `inprocess` store section runs on the store's ray deployment (same capacity, lease and "
        "sampler options); as_configured: use the store section as written.",
    )
    heartbeat_s: float = Field(2.0, gt=0, description="Seconds between health checks of each actor.")
    heartbeat_timeout_s: float = Field(
        60.0, gt=0,
        description="An actor that does not answer a health check (or a generate poll) within this is declared dead "
        "and killed.",
    )
    max_restarts: int = Field(
        3, ge=0,
        description="Times each rollout replica, reward worker and reward-model replica is replaced after dying; then "
        "it stays dead."
    )
    start_timeout_s: float = Field(
        300.0, gt=0, description="Wait this long for the placement groups' resources before refusing to start."
    )
