"""The rollout proxy passes the RolloutEngine conformance suite: the toy engine in a Ray actor, driven remotely.

What the suite checks for an in-process engine (one result per request in
completion order, abort through ``generate``, pause/resume, weight updates
at a safe point, a bad bucket refused with the old version kept, health,
double shutdown) must hold unchanged when the engine sits behind
:class:`~asyncflow_core.launchers.ray.remote.RemoteRolloutEngine`: the
stages rely on exactly that contract.
"""

from __future__ import annotations

from collections import Counter

import pytest

ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")

from asyncflow_spec import RolloutEngineSpec  # noqa: E402

from asyncflow_core.launchers.ray.launcher import _RemoteRollout  # noqa: E402
from asyncflow_core.launchers.ray.remote import RemoteRolloutEngine, WatchedActor  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402


class TestRemoteToyRollout(RolloutEngineSpec):
    backend = "toy"
    options = {"vocab_size": 16}  # noqa: RUF012 - the suite reads it as a class attribute

    def weights(self):
        from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table

        return {PARAM_NAME: initial_table(16, seed=1, init_scale=1.0)}

    @pytest.fixture
    def make_backend(self):
        pm = get_plugin_manager()
        factory = pm.lookup(self.kind, self.backend).record.factory
        made: list[RemoteRolloutEngine] = []

        def make(**overrides):
            options = pm.validate_options(self.kind, self.backend, {**self.options, **overrides})
            watched = WatchedActor(f"rollout/{len(made)}",
                                   lambda: _RemoteRollout.options(num_cpus=0).remote(factory, options),
                                   heartbeat_s=5.0, heartbeat_timeout_s=60.0)
            engine = RemoteRolloutEngine(watched, deadline_s=60.0, max_restarts=0, bucket_cache={},
                                         counters=Counter())
            made.append(engine)
            return engine

        yield make
        for engine in made:
            engine.watched.kill()
