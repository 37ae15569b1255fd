"""The plugin system: hookspecs, registration records and the plugin manager.

Plugin authors need only this module::

    from asyncflow_core.plugins import RolloutEngineBackend, hookimpl
"""

from asyncflow_core.plugins.hookspec import ENTRY_POINT_GROUP, PROJECT_NAME, AsyncflowHookSpecs, hookimpl, hookspec
from asyncflow_core.plugins.manager import (
    BLOCKED_ENV,
    BUILTIN_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    EXTRA_PLUGINS_ENV,
    AsyncflowPluginManager,
    get_plugin_manager,
)
from asyncflow_core.plugins.types import (
    AlgorithmBackend,
    DatasetBackend,
    EnvironmentBackend,
    LauncherBackend,
    StageBackend,
    NoOptions,
    PluginKind,
    Registered,
    Registration,
    RewardBackend,
    RolloutEngineBackend,
    SamplerBackend,
    StoreBackend,
    TrainEngineBackend,
    WeightTransportBackend,
)

__all__ = [
    "BLOCKED_ENV",
    "BUILTIN_PLUGINS",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "EXTRA_PLUGINS_ENV",
    "PROJECT_NAME",
    "AlgorithmBackend",
    "AsyncflowHookSpecs",
    "AsyncflowPluginManager",
    "DatasetBackend",
    "EnvironmentBackend",
    "LauncherBackend",
    "StageBackend",
    "NoOptions",
    "PluginKind",
    "Registered",
    "Registration",
    "RewardBackend",
    "RolloutEngineBackend",
    "SamplerBackend",
    "StoreBackend",
    "TrainEngineBackend",
    "WeightTransportBackend",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
]
