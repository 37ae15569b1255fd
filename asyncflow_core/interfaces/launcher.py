"""The Launcher contract: where and how a run's roles are started."""

from __future__ import annotations

import abc
from typing import Any


class Launcher(abc.ABC):
    """Starts the roles of a run (engines, store, stages), runs it, and tears it down.

    ``run`` receives the validated run configuration and returns a summary of
    the run (at least ``{"steps": int}``); it raises
    :class:`~asyncflow_core.errors.AsyncflowError` subclasses for failures a
    user can act on. ``shutdown`` stops everything it started, even after a
    failure, and is safe to call twice.
    """

    @abc.abstractmethod
    async def run(self, config: Any) -> dict[str, Any]:
        """Run the job described by ``config`` (a :class:`~asyncflow_core.config.RunConfig`) to completion."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop every process, actor and listener this launcher started."""
