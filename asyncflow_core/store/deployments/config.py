"""Config models of the out-of-process store deployments (pydantic, extra="forbid")."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _StoreOptions(BaseModel):
    """Controller options every deployment shares (same names as the ``inprocess`` store's)."""

    model_config = ConfigDict(extra="forbid")

    capacity: int = Field(65536, ge=1, description="Most live rows (put and not yet collected); put blocks or fails beyond.")
    lease_s: float = Field(600.0, gt=0, description="Default lease length in seconds; an unacknowledged lease then returns to free.")
    sampler: str = Field("fifo", description="Sampler used when get_meta names none (a registered sampler name).")
    sampler_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Options per sampler name, passed to the sampler's config model."
    )
    group_size: int = Field(0, ge=0, description="Rows per complete prompt group, for the group sampler (0: ungrouped).")
    token_columns: tuple[str, ...] = Field(
        ("prompt_ids", "response_ids"),
        description="Ragged columns whose lengths sum to a row's token count (used by length-aware samplers).",
    )

    def controller(self):
        """A Controller built from these options."""
        from asyncflow_core.store.controller import Controller

        return Controller(
            self.capacity, group_size=self.group_size, sampler_options=self.sampler_options,
            default_sampler=self.sampler, default_lease_s=self.lease_s,
        )


class MultiprocessStoreConfig(_StoreOptions):
    """Options of the ``multiprocess`` store."""

    address: str | None = Field(
        None, description="Unix socket of a running server to join; leave unset to start a server in this process."
    )
    token_env: str = Field(
        "ASYNCFLOW_STORE_TOKEN", description="Environment variable holding the server's secret token when joining."
    )
    arena_mb: int = Field(1024, ge=1, description="Size of the shared-memory arena holding column bytes (MiB).")


class DistributedStoreConfig(_StoreOptions):
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


class RayStoreConfig(_StoreOptions):
    """Options of the ``ray`` store (controller and storage unit as Ray actors)."""

    name: str | None = Field(
        None, description="Name of the controller actor: set it to share one store between drivers/actors."
    )
    namespace: str | None = Field(None, description="Ray namespace of the named actors.")
    num_storage_units: int = Field(1, ge=1, description="Storage unit actors; rows are spread over them by row id.")
