"""Controller options every store deployment shares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StoreOptions(BaseModel):
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
    max_candidates: int = Field(
        65536, ge=0, description="Most eligible rows (the oldest) a sampler sees per get_meta, at least 4x the batch; 0: all."
    )

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, value: str) -> str:
        from asyncflow_core.plugins import get_plugin_manager  # late: the options import without the plugins

        known = get_plugin_manager().registrations("sampler")
        if known and value not in known:  # no sampler plugin at all: nothing to check against
            raise ValueError(f"no sampler named {value!r}; available: {', '.join(sorted(known))}")
        return value

    def controller(self):
        """A Controller built from these options."""
        from asyncflow_core.store.controller import Controller

        return Controller(
            self.capacity, group_size=self.group_size, sampler_options=self.sampler_options,
            default_sampler=self.sampler, default_lease_s=self.lease_s,
            max_candidates=self.max_candidates,
        )
