"""The pytest plugin entry point (``pytest11``): markers and options of the suite."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "asyncflow_spec: a test of the asyncflow conformance suite")
