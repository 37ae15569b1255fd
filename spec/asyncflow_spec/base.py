"""The base every interface's spec class builds on.

A backend's test module subclasses a spec class and names its backend::

    from asyncflow_spec import RolloutEngineSpec

    class TestMyEngine(RolloutEngineSpec):
        backend = "my-engine"            # the name its plugin registered
        options = {"model": "tiny"}      # validated by the plugin's config model

Everything the tests need (fixtures, helpers, the async runner) ships with
this package; nothing is taken from the host project's conftest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import pytest

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.plugins import PluginKind, get_plugin_manager


def run(coro: Coroutine[Any, Any, Any], *, timeout: float = 120.0) -> Any:
    """Run ``coro`` on a fresh event loop with a deadline (a hung backend fails, never hangs the suite)."""

    async def guarded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


class BackendSpec:
    """Common machinery: builds the backend under test from its plugin registration.

    Class attributes a subclass sets:

    - ``backend``: registered name (required).
    - ``options``: options for its config model (default: the model's defaults).

    The ``backend_options`` fixture is what the backend is built with:
    ``options``, plus what a spec class supplies itself (the rollout spec's
    tiny model, for an engine that takes a ``model``).
    """

    kind: ClassVar[PluginKind]
    backend: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        """The options the backend under test is built with (``options`` unless a spec class adds fixtures)."""
        return dict(self.options)

    @pytest.fixture
    def make_backend(self, backend_options: dict[str, Any]) -> Callable[..., Any]:
        """``make_backend(**overrides)`` builds a new backend with ``backend_options`` updated by ``overrides``."""
        if not self.backend:
            pytest.fail(f"{type(self).__name__} must set `backend` to the registered {self.kind.value} name")
        return Maker(self.kind, self.backend, backend_options)

    @pytest.fixture
    def registration(self):
        """The plugin registration record of the backend under test."""
        return get_plugin_manager().lookup(self.kind, self.backend)


class Maker:
    """Builds the backend under test from its registration; ``options`` are the ones it is built with."""

    def __init__(self, kind: PluginKind, backend: str, options: dict[str, Any]) -> None:
        self.kind, self.backend, self.options = kind, backend, options

    def __call__(self, **overrides: Any) -> Any:
        return get_plugin_manager().create(self.kind, self.backend, {**self.options, **overrides})


def require(features: Any, flag: str) -> None:
    """Skip the calling test, with the reason, when ``features.<flag>`` is off."""
    if not getattr(features, flag):
        pytest.skip(f"{flag} is False in this backend's Features")


def forbid(features: Any, flag: str) -> None:
    """Skip the calling test when ``features.<flag>`` is on (for tests of the documented error)."""
    if getattr(features, flag):
        pytest.skip(f"{flag} is True in this backend's Features; the unsupported-path test does not apply")


async def expect_unsupported(coro: Coroutine[Any, Any, Any], what: str) -> None:
    """Assert ``coro`` raises :class:`UnsupportedFeatureError`, as the contract demands for a disabled feature."""
    try:
        await coro
    except UnsupportedFeatureError:
        return
    except Exception as exc:  # noqa: BLE001 - report what the backend did instead
        pytest.fail(f"{what} must raise UnsupportedFeatureError when its feature flag is off, raised {exc!r}")
    pytest.fail(f"{what} must raise UnsupportedFeatureError when its feature flag is off, but returned")
