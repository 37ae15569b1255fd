"""asyncflow core: interfaces, plugin manager, config, store, flow runtime, launchers, telemetry and CLI.

This package imports no plugin or adapter; it finds them through the plugin
manager (``asyncflow_core.plugins``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("asyncflow")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
