"""Options of the ``shm``, ``dist`` and ``disk`` weight transports (light: no torch import)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SHM_NAME_PATTERN = r"^[A-Za-z0-9_.]{1,64}$"


class ShmTransportConfig(BaseModel):
    """Options of the ``shm`` weight transport."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        pattern=SHM_NAME_PATTERN,
        description="Shared name that the sender and its receivers open (letters, digits, '_' and '.'). "
        "None picks a private name: only this object can receive (single-process use).",
    )
    directory: str = Field(
        "/dev/shm",
        description="Where segments and the manifest live; /dev/shm keeps them in RAM. Falls back to the "
        "temporary directory when it does not exist (e.g. macOS).",
    )
    poll_interval_s: float = Field(0.005, gt=0, description="How often a waiting receiver re-reads the manifest.")
    reuse_buffers: bool = Field(
        True,
        description="A receiver maps the sender's segment (no copy; the sender keeps its segments across versions "
        "and reuses one once no receiver maps it); False: a receiver copies each version into fresh memory.",
    )


class DistTransportConfig(BaseModel):
    """Options of the ``dist`` weight transport (the same on every rank except ``rank``)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(0, ge=0, description="This process's rank in the transport's group.")
    world_size: int = Field(1, ge=1, description="Ranks in the group: the source plus one per receiver.")
    source_rank: int = Field(0, ge=0, description="The rank that sends (the trainer's exporting rank).")
    port: int = Field(
        0, ge=0, le=65535,
        description="Rendezvous port on 127.0.0.1 (rank 0 listens on it). 0 picks a free one: only with world_size 1.",
    )
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="gloo moves CPU buffers; nccl moves CUDA buffers (receivers get them on their device)."
    )
    device: str | None = Field(
        None,
        pattern=r"^(cuda(:\d+)?|\d+)$",
        description="nccl only: this rank's CUDA device (an index or cuda:N). Unset: LOCAL_RANK when the launcher "
        "sets it, else the current device of the process that builds the transport.",
    )
    chunk_mb: float = Field(16.0, gt=0, description="Largest broadcast message in MiB: each bucket travels in "
                            "pieces of this size (its last one shorter).")
    keep_buffers: bool = Field(
        True,
        description="gloo receivers receive each version into buffers kept across versions, reused once nothing "
        "holds the version they carried (a received page is not faulted in again; the price is a second version's "
        "memory in the steady state). False: fresh memory for every version. NCCL receivers always get fresh "
        "device memory.",
    )
    join_timeout_s: float = Field(120.0, gt=0, description="How long the ranks may take to join the group.")
    poll_interval_s: float = Field(0.002, gt=0, description="How often control keys are checked while waiting.")

    @model_validator(mode="after")
    def _consistent(self) -> DistTransportConfig:
        if self.rank >= self.world_size or self.source_rank >= self.world_size:
            raise ValueError(f"rank {self.rank} and source_rank {self.source_rank} must be < world_size {self.world_size}")
        if self.world_size > 1 and self.port == 0:
            raise ValueError("a group of several ranks needs a fixed port that every rank is given (port=0 picks one "
                             "only this process knows)")
        if self.device is not None and self.backend != "nccl":
            raise ValueError(f"device={self.device!r} applies to backend 'nccl' only (gloo moves CPU buffers); "
                             "remove it or set backend: nccl")
        return self

    @property
    def chunk_bytes(self) -> int:
        return max(64, int(self.chunk_mb * (1 << 20)) // 64 * 64)


class DiskTransportConfig(BaseModel):
    """Options of the ``disk`` weight transport."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None,
        description="Directory that holds the versions (created if missing); sender and receivers open the same one. "
        "None makes a private temporary directory, removed on close (single-process use).",
    )
    keep_last: int = Field(2, ge=1, description="Versions kept after each send; older ones are deleted.")
    poll_interval_s: float = Field(0.05, gt=0, description="How often a waiting receiver lists the directory.")
    fsync: bool = Field(False, description="fsync the files and directory before publishing (survives a power "
                        "loss; not needed for other processes to see the version).")
