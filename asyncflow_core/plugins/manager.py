"""The plugin manager: discovery, conflict checks, typed lookups and construction."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable, Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from asyncflow_core.errors import ConfigError, PluginConflictError, PluginError, UnknownPluginError
from asyncflow_core.plugins.hookspec import ENTRY_POINT_GROUP, PROJECT_NAME, AsyncflowHookSpecs
from asyncflow_core.plugins.types import RECORD_TYPES, PluginKind, Registered, Registration

#: Built-in plugin modules, registered first, in this order. They ship in the
#: ``asyncflow`` distribution and are imported by name so that discovery stays
#: one-way: ``asyncflow_core`` has no import-time dependency on them.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "asyncflow_plugins.samplers",
    "asyncflow_core.store.plugin",
    "asyncflow_core.store.deployments.plugin",
    "asyncflow_plugins.transports",
    "asyncflow_plugins.toy",
    "asyncflow_plugins.sim",
    "asyncflow_plugins.hf",
    "asyncflow_plugins.algorithms",
    "asyncflow_plugins.rewards",
    "asyncflow_plugins.rewards_model",
    "asyncflow_plugins.datasets",
    "asyncflow_plugins.arithmetic",
    "asyncflow_plugins.envs",
    "asyncflow_core.flow.launcher",
)

DISABLE_AUTOLOAD_ENV = "ASYNCFLOW_DISABLE_PLUGIN_AUTOLOAD"
"""Set to ``1`` to skip entry-point plugins (built-ins still load)."""

BLOCKED_ENV = "ASYNCFLOW_BLOCKED_PLUGINS"
"""Comma-separated plugin (entry-point or built-in module) names or distribution names not to load."""

EXTRA_PLUGINS_ENV = "ASYNCFLOW_PLUGINS"
"""Comma-separated entry-point names to load even when autoload is disabled."""

BUILTIN_DISTRIBUTION = "asyncflow"


def _env_list(name: str) -> set[str]:
    return {item.strip() for item in os.environ.get(name, "").split(",") if item.strip()}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _dist_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


class AsyncflowPluginManager(pluggy.PluginManager):
    """pluggy's manager plus asyncflow's discovery rules and a typed facade.

    Use :func:`get_plugin_manager` for the shared, fully loaded instance.
    """

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(AsyncflowHookSpecs)
        self._origin: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self._registry: dict[PluginKind, dict[str, Registered]] | None = None

    # -- loading ------------------------------------------------------------

    def load_plugins(self) -> None:
        """Built-ins (from :data:`BUILTIN_PLUGINS`), then entry points, then ``check_pending()``.

        Honours :data:`DISABLE_AUTOLOAD_ENV`, :data:`BLOCKED_ENV` and
        :data:`EXTRA_PLUGINS_ENV`, and checks for name conflicts.
        """
        blocked = _env_list(BLOCKED_ENV)
        for name in blocked:
            self.set_blocked(name)
        builtin_version = _dist_version(BUILTIN_DISTRIBUTION)
        for module_name in BUILTIN_PLUGINS:
            if module_name in blocked or self.is_blocked(module_name):
                continue
            self.register_module(module_name, distribution=BUILTIN_DISTRIBUTION, version=builtin_version)
        self._load_entry_points(blocked)
        self.check_pending()
        self.collect()

    def register_module(
        self, module: str | ModuleType, *, distribution: str, version: str = "unknown", name: str | None = None
    ) -> None:
        """Import (if given by name) and register a plugin module, recording where it came from."""
        if isinstance(module, str):
            try:
                module = importlib.import_module(module)
            except Exception as exc:  # a broken plugin must say which one it is
                raise PluginError(f"plugin module {module!r} from {distribution} failed to import: {exc}") from exc
        plugin_name = name or module.__name__
        if self.get_plugin(plugin_name) is not None:
            return
        self.register(module, name=plugin_name)
        self._origin[plugin_name] = (distribution, version)
        self._registry = None

    def _load_entry_points(self, blocked: set[str]) -> None:
        wanted = _env_list(EXTRA_PLUGINS_ENV)
        autoload = not _truthy(DISABLE_AUTOLOAD_ENV)
        if not autoload and not wanted:
            return
        seen_names: set[str] = set()
        for dist in metadata.distributions():
            dist_name = dist.metadata["Name"] or "unknown"
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP:
                    continue
                if not autoload and ep.name not in wanted:
                    continue
                if ep.name in blocked or dist_name in blocked or self.is_blocked(ep.name):
                    continue
                if ep.name in seen_names or self.get_plugin(ep.name) is not None:
                    continue  # the same distribution seen twice on sys.path
                seen_names.add(ep.name)
                try:
                    module = ep.load()
                except Exception as exc:
                    raise PluginError(
                        f"plugin {ep.name!r} ({ep.value}) from distribution {dist_name} failed to import: {exc}. "
                        f"Fix or uninstall it, or skip it with {BLOCKED_ENV}={ep.name}"
                    ) from exc
                self.register_module(module, distribution=dist_name, version=dist.version, name=ep.name)

    # -- registry -----------------------------------------------------------

    def origin(self, plugin_name: str) -> tuple[str, str]:
        """``(distribution, version)`` of a registered plugin (``("unknown", "unknown")`` if registered by hand)."""
        return self._origin.get(plugin_name, ("unknown", "unknown"))

    def collect(self) -> dict[PluginKind, dict[str, Registered]]:
        """Call every hook and index the records by kind and name; raises on conflicts.

        Each hook implementation is called on its own so every record is
        attributed to the plugin (and distribution) that returned it.
        """
        if self._registry is not None:
            return self._registry
        registry: dict[PluginKind, dict[str, Registered]] = {kind: {} for kind in PluginKind}
        for kind in PluginKind:
            hook = getattr(self.hook, kind.hook_name)
            record_type = RECORD_TYPES[kind]
            for impl in hook.get_hookimpls():
                plugin_name = self.get_name(impl.plugin) or repr(impl.plugin)
                dist, version = self.origin(plugin_name)
                try:
                    records = list(impl.function() or ())
                except PluginError:
                    raise
                except Exception as exc:
                    raise PluginError(
                        f"hook {kind.hook_name} of plugin {plugin_name!r} ({dist}) raised {type(exc).__name__}: {exc}"
                    ) from exc
                for record in records:
                    if not isinstance(record, record_type):
                        raise PluginError(
                            f"hook {kind.hook_name} of plugin {plugin_name!r} ({dist}) returned "
                            f"{type(record).__name__}; it must return {record_type.__name__} records"
                        )
                    existing = registry[kind].get(record.name)
                    if existing is not None:
                        raise PluginConflictError(
                            f"{kind.value} {record.name!r} is registered twice: by plugin {existing.plugin!r} "
                            f"from distribution {existing.distribution} {existing.version} and by plugin "
                            f"{plugin_name!r} from distribution {dist} {version}. Uninstall one, or block one "
                            f"with {BLOCKED_ENV}=<plugin or distribution name>"
                        )
                    registry[kind][record.name] = Registered(record, plugin_name, dist, version)
        self._registry = registry
        return registry

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._registry = None
        return super().unregister(plugin, name)

    # -- typed facade -------------------------------------------------------

    def registrations(self, kind: PluginKind | str) -> Mapping[str, Registered]:
        """Everything registered for ``kind``, by name."""
        return self.collect()[PluginKind(kind)]

    def lookup(self, kind: PluginKind | str, name: str) -> Registered:
        """The registration of ``name``; :class:`UnknownPluginError` lists what exists otherwise."""
        kind = PluginKind(kind)
        found = self.registrations(kind).get(name)
        if found is None:
            available = ", ".join(sorted(self.registrations(kind))) or "none"
            raise UnknownPluginError(
                f"no {kind.value} named {name!r}; available: {available}. "
                "Install the plugin that provides it, or check `asyncflow plugins`"
            )
        return found

    def validate_options(
        self, kind: PluginKind | str, name: str, options: Mapping[str, Any] | BaseModel | None, *, where: str = ""
    ) -> BaseModel:
        """Validate ``options`` against the plugin's config model; :class:`ConfigError` names each bad field."""
        record = self.lookup(kind, name).record
        if isinstance(options, record.config_model):
            return options
        if isinstance(options, BaseModel):
            options = options.model_dump()
        try:
            return record.config_model.model_validate(dict(options or {}))
        except ValidationError as exc:
            from asyncflow_core.config.errors import format_validation_error

            prefix = where or f"{PluginKind(kind).value} {name!r} options"
            raise ConfigError(format_validation_error(exc, prefix=prefix, model=record.config_model)) from None

    def create(
        self, kind: PluginKind | str, name: str, options: Mapping[str, Any] | BaseModel | None = None
    ) -> Any:
        """Validate ``options`` and build the backend ``name`` of ``kind``."""
        config = self.validate_options(kind, name, options)
        return self.lookup(kind, name).record.factory(config)

    def all_registrations(self) -> Iterable[Registered]:
        """Every record of every kind, kinds in :class:`PluginKind` order, names sorted."""
        for kind, by_name in self.collect().items():
            for name in sorted(by_name):
                yield by_name[name]


@functools.cache
def get_plugin_manager() -> AsyncflowPluginManager:
    """The process-wide plugin manager, loaded on first use.

    Tests that change the installed plugins or the environment variables call
    ``get_plugin_manager.cache_clear()`` to rediscover.
    """
    pm = AsyncflowPluginManager()
    pm.load_plugins()
    return pm
