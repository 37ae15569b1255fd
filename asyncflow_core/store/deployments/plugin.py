"""Built-in plugin registering the out-of-process store deployments (``multiprocess`` today).

The ``distributed`` (torch.distributed data plane) and ``ray`` deployments are
planned; their config models live in :mod:`.config` and are not registered
until their implementations land, so no config can pick a backend that does
not work.

Heavy modules (ray, torch.distributed, the servers) load inside the
factories, so plugin discovery stays cheap.
"""

from __future__ import annotations

import os
from typing import Any

from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.plugins import StoreBackend, hookimpl
from asyncflow_core.store.deployments.config import MultiprocessStoreConfig


def _token(env: str) -> str:
    token = os.environ.get(env)
    if not token:
        from asyncflow_core.errors import ConfigError

        raise ConfigError(
            f"joining a store server needs its token in the environment variable {env}; set it to the token the "
            "server process published (store.token), or leave `address` unset to start a server here"
        )
    return token


def _make_multiprocess(config: MultiprocessStoreConfig) -> Any:
    from asyncflow_core.store.deployments.multiprocess import MultiprocessStore

    if config.address:
        return MultiprocessStore(config.address, _token(config.token_env), token_columns=config.token_columns)
    return MultiprocessStore.serve(arena_mb=config.arena_mb, controller=config.controller(),
                                   token_columns=config.token_columns)


MULTIPROCESS_FEATURES = StoreFeatures(deployment="multiprocess", zero_copy_get=False, supports_checkpoint=True)


@hookimpl
def asyncflow_stores():
    yield StoreBackend(
        name="multiprocess",
        factory=_make_multiprocess,
        config_model=MultiprocessStoreConfig,
        description="Server process on one host; clients anywhere on it; tensors through shared memory.",
        features=MULTIPROCESS_FEATURES,
    )
