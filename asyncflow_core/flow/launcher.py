"""The built-in launchers: ``local`` (every role in this process on one asyncio loop, the embedded default) and
the registration of ``ray`` (:mod:`asyncflow_core.launchers.ray`), plus :func:`launch`, which runs a config
with the launcher it names."""

from __future__ import annotations

import asyncio
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
    """Run ``resolved`` with the launcher its config names (``virtual`` selects the virtual clock: local only)."""
    from asyncflow_core.flow.runtime import run_flow

    name = resolved.config.launcher.name
    if name == "local":
        return run_flow(resolved, virtual=virtual, run_dir=run_dir, progress=progress, resume=resume)
    if virtual:
        raise ConfigError(f"asyncflow sim runs the virtual clock in one process; launcher.name: {name} cannot, "
                          "use launcher.name: local (or asyncflow run)")
    launcher = resolved.components["launcher"]
    backend = launcher.registered.record.factory(launcher.options)

    async def main() -> dict[str, Any]:
        try:
            return await backend.run(resolved, run_dir=run_dir, progress=progress, resume=resume)
        finally:
            await backend.shutdown()

    return asyncio.run(main())


def _make_ray(config: Any) -> Launcher:
    try:
        from asyncflow_core.launchers.ray.launcher import RayLauncher
    except ImportError as exc:
        raise ConfigError(f"launcher.name: ray needs Ray ({exc}); install it with pip install 'asyncflow[ray]'") \
            from None
    return RayLauncher(config)


@hookimpl
def asyncflow_launchers():
    yield LauncherBackend(
        name="local",
        factory=LocalLauncher,
        config_model=NoOptions,
        description="Every role in this process on one asyncio loop; engines use worker threads or their own ranks.",
    )
    from asyncflow_core.launchers.ray.config import RayLauncherConfig  # pydantic only: Ray loads when a run starts

    yield LauncherBackend(
        name="ray",
        factory=_make_ray,
        config_model=RayLauncherConfig,
        description="Rollout replicas, trainer and reward workers as Ray actors (placement groups, heartbeats, "
        "restarts); the store on its ray deployment.",
    )
