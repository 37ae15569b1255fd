"""Built-in plugin registering the out-of-process store deployments: ``multiprocess``, ``distributed``, ``ray``.

Config models live in :mod:`.config` and each deployment's features in
:mod:`.features` (its store answers with the same object, and imports
nothing from here); a deployment is registered only once its implementation
lands, so no config can pick a backend that does not work.

Heavy modules (ray, torch.distributed, the servers) load inside the
factories, so plugin discovery stays cheap.
"""

from __future__ import annotations

import os
from typing import Any

from asyncflow_core.plugins import StoreBackend, hookimpl
from asyncflow_core.store.deployments.config import DistributedStoreConfig, MultiprocessStoreConfig, RayStoreConfig
from asyncflow_core.store.deployments.features import DISTRIBUTED_FEATURES, MULTIPROCESS_FEATURES, RAY_FEATURES


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


def _make_distributed(config: DistributedStoreConfig) -> Any:
    from asyncflow_core.store.deployments.distributed import open_distributed_store

    return open_distributed_store(config)


def _make_ray(config: RayStoreConfig) -> Any:
    try:
        from asyncflow_core.store.deployments.ray_store import RayStore
    except ImportError as exc:
        from asyncflow_core.errors import ConfigError

        raise ConfigError(f"the ray store needs Ray ({exc}); install it with pip install 'asyncflow[ray]'") from exc
    return RayStore(config)


@hookimpl
def asyncflow_stores():
    yield StoreBackend(
        name="multiprocess",
        factory=_make_multiprocess,
        config_model=MultiprocessStoreConfig,
        description="Server process on one host; clients anywhere on it; tensors through shared memory.",
        features=MULTIPROCESS_FEATURES,
    )
    yield StoreBackend(
        name="distributed",
        factory=_make_distributed,
        config_model=DistributedStoreConfig,
        description="Controller and storage on one rank; tensors point to point by torch.distributed (gloo/NCCL).",
        features=DISTRIBUTED_FEATURES,
    )
    yield StoreBackend(
        name="ray",
        factory=_make_ray,
        config_model=RayStoreConfig,
        description="Controller and storage units as Ray actors; clients anywhere in the Ray cluster.",
        features=RAY_FEATURES,
    )
