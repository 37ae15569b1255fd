"""The ``local`` launcher: every role in this process on one asyncio loop (the embedded default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncflow_core.config.loader import ResolvedConfig
from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import Launcher
from asyncflow_core.plugins import LauncherBackend, NoOptions, hookimpl


class LocalLauncher(Launcher):
    """Runs :class:`~asyncflow_core.flow.runtime.FlowRuntime` on the loop it is awaited on."""

    def __init__(self, config: NoOptions | None = None) -> None:
        self._runtime = None

    async def run(self, config: Any, *, run_dir: Path | None = None, progress: bool = False) -> dict[str, Any]:
        from asyncflow_core.config.loader import resolve
        from asyncflow_core.flow.runtime import FlowRuntime

        resolved = config if isinstance(config, ResolvedConfig) else resolve(config)
        self._runtime = FlowRuntime(resolved, run_dir=run_dir, progress=progress)
        return await self._runtime.run()

    async def shutdown(self) -> None:
        """The runtime tears down its engines and store itself when ``run`` returns or raises."""


def launch(resolved: ResolvedConfig, *, virtual: bool = False, run_dir: Path | None = None,
           progress: bool = False, resume: bool = False) -> dict[str, Any]:
    """Run ``resolved`` with its launcher (``local`` runs here; ``virtual`` selects the virtual clock)."""
    from asyncflow_core.flow.runtime import run_flow

    name = resolved.config.launcher.name
    if name != "local":
        raise ConfigError(
            f"launcher {name!r} cannot run from this command yet; use launcher.name: local "
            "(`asyncflow plugins --kind launcher` lists what is installed)"
        )
    return run_flow(resolved, virtual=virtual, run_dir=run_dir, progress=progress, resume=resume)


@hookimpl
def asyncflow_launchers():
    yield LauncherBackend(
        name="local",
        factory=LocalLauncher,
        config_model=NoOptions,
        description="Every role in this process on one asyncio loop; engines use worker threads or their own ranks.",
    )
