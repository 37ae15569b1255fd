"""Config models of the out-of-process store deployments (pydantic, extra="forbid")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncflow_core.store.options import StoreOptions


class MultiprocessStoreConfig(StoreOptions):
    """Options of the ``multiprocess`` store."""

    address: str | None = Field(
        None, description="Unix socket of a running server to join; leave unset to start a server in this process."
    )
    token_env: str = Field(
        "ASYNCFLOW_STORE_TOKEN", description="Environment variable holding the server's secret token when joining."
    )
    arena_mb: int = Field(1024, ge=1, description="Size of the shared-memory arena holding column bytes (MiB).")


class DistributedStoreConfig(StoreOptions):
    """Options of the ``distributed`` store (torch.distributed data plane; controller and storage on one rank).

    Clients find the server rank's control socket and token in the process
    group's rendezvous store, so no address or secret is configured by hand.
    """

    name: str | None = Field(
        "default",
        description="Store instance on the server rank: ranks opening the same name share it (the first opener's "
        "options win); null opens a fresh private instance that is dropped when its client closes.",
    )
    server_rank: int = Field(0, ge=0, description="Global rank of the process that hosts controller and storage.")
    arena_mb: int = Field(1024, ge=1, description="Column memory of one store instance on the server rank (MiB).")
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="Backend used by init_process_group: gloo (CPU tensors) or nccl (GPU tensors)."
    )
    init_process_group: bool = Field(
        False, description="Initialise torch.distributed from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE if not yet done."
    )
    device: str | None = Field(
        None,
        pattern=r"^(cuda(:\d+)?|\d+)$",
        description="nccl only: this rank's CUDA device (an index or cuda:N); get() returns tensors there. Unset: "
        "LOCAL_RANK when the launcher sets it, else the current device of the process that opens the store.",
    )
    timeout_s: float = Field(
        300.0, gt=0, description="Seconds to wait for the process group to form and for the server rank to publish; "
        "with nccl also the deadline of one transfer, after which the lane's communicator is aborted.",
    )


class RayStoreConfig(StoreOptions):
    """Options of the ``ray`` store (controller and storage unit as Ray actors)."""

    name: str | None = Field(
        None, description="Name of the controller actor: set it to share one store between drivers/actors."
    )
    namespace: str | None = Field(None, description="Ray namespace of the named actors.")
    num_storage_units: int = Field(
        1, ge=1, description="Storage unit actors; they take puts in turn, keep each put's object mapped, and serve "
        "arena data of their node to readers on other nodes.")
