"""An environment plugin registered by hand in the rollout process (a test, a notebook, a benchmark script) runs in
worker processes too: the pool's factory carries the registering module, and a worker that does not find the
name among its built-ins and entry points registers that module."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest

from asyncflow_core.errors import EnvironmentFailure
from asyncflow_core.flow.env_pool import EnvironmentPool, PluginEnvironmentFactory
from asyncflow_core.interfaces import Action
from asyncflow_core.plugins import get_plugin_manager

from . import pool_fixtures
from .pool_fixtures import PLUGIN_NAME


@pytest.fixture
def registered():
    pm = get_plugin_manager()
    pm.register_module(pool_fixtures, distribution="tests")
    try:
        yield pm
    finally:
        pm.unregister(name=pool_fixtures.__name__)


def test_the_factory_carries_the_registering_module_across_pickling(registered):
    factory = PluginEnvironmentFactory(PLUGIN_NAME)
    assert factory.features.blocking
    copy = pickle.loads(pickle.dumps(factory))
    assert copy.name == PLUGIN_NAME and copy._plugin_module() == pool_fixtures.__name__
    built = PluginEnvironmentFactory("calculator")
    assert pickle.loads(pickle.dumps(built))._plugin_module() == "asyncflow_plugins.envs"  # harmless for built-ins


def test_a_hand_registered_blocking_environment_runs_in_a_worker_process(registered):
    async def main():
        async with EnvironmentPool.from_plugin(PLUGIN_NAME, processes=1) as pool:
            async with pool.episode() as env:
                await env.reset({"turns": 1}, seed=0)
                return await env.step(Action(token_ids=(), text="x", finish_reason="stop", turn=0))

    step = asyncio.run(asyncio.wait_for(main(), 120))
    assert step.done and step.reward == 1.0 and step.info["pid"] != os.getpid()


def test_an_unknown_environment_still_fails_with_its_reason():
    async def main():
        factory = PluginEnvironmentFactory("no_such_environment_here")
        async with EnvironmentPool(factory, processes=1) as pool:
            with pytest.raises(EnvironmentFailure) as info:
                await pool.open()
            return info.value.reason

    reason = asyncio.run(asyncio.wait_for(main(), 120))
    assert reason.startswith("environment open failed: UnknownPluginError: no environment named "
                             "'no_such_environment_here'")
