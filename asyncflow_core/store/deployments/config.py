"""Config models of the out-of-process store deployments (pydantic, extra="forbid")."""

from __future__ import annotations

from typing import Any, Literal

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
    """Options of the ``distributed`` store (torch.distributed data plane)."""

    address: str | None = Field(
        None, description="Unix socket of the server rank's control channel to join; unset on the server rank."
    )
    token_env: str = Field(
        "ASYNCFLOW_STORE_TOKEN", description="Environment variable holding the server's secret token when joining."
    )
    server_rank: int = Field(0, ge=0, description="Rank of the process that hosts controller and storage.")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend: gloo (CPU) or nccl (GPU).")
    init_process_group: bool = Field(
        False, description="Initialise torch.distributed from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE if not yet done."
    )


class RayStoreConfig(StoreOptions):
    """Options of the ``ray`` store (controller and storage unit as Ray actors)."""

    name: str | None = Field(
        None, description="Name of the controller actor: set it to share one store between drivers/actors."
    )
    namespace: str | None = Field(None, description="Ray namespace of the named actors.")
    num_storage_units: int = Field(1, ge=1, description="Storage unit actors; rows are spread over them by row id.")
