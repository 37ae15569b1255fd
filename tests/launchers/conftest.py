"""One loopback-only Ray for every test of the launchers (127.0.0.1, no dashboard), shut down after the last."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def local_ray():
    ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")
    from asyncflow_core.store.deployments.ray_store import init_local_ray

    started = not ray.is_initialized()
    init_local_ray(num_cpus=4)
    yield
    if started:
        ray.shutdown()
