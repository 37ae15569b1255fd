"""Shared fixtures. Tests that change discovery get a fresh plugin manager before and after."""

import pytest

from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.plugins.manager import BLOCKED_ENV, DISABLE_AUTOLOAD_ENV, EXTRA_PLUGINS_ENV


@pytest.fixture
def fresh_plugins(monkeypatch):
    """Rediscover plugins under this test's environment; restore the shared manager afterwards."""
    for var in (BLOCKED_ENV, DISABLE_AUTOLOAD_ENV, EXTRA_PLUGINS_ENV):
        monkeypatch.delenv(var, raising=False)
    get_plugin_manager.cache_clear()
    yield
    get_plugin_manager.cache_clear()
