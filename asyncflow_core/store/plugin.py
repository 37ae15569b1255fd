"""Built-in plugin registering the ``inprocess`` store deployment."""

from __future__ import annotations

from typing import Any

from asyncflow_core.store.deployments.features import INPROCESS_FEATURES
from asyncflow_core.plugins import StoreBackend, hookimpl


def _make_inprocess(config: Any):
    from asyncflow_core.store.inprocess import InProcessStore  # the store module loads only when a store is built

    return InProcessStore(config)


def _config_model():
    from asyncflow_core.store.inprocess import InProcessStoreConfig

    return InProcessStoreConfig


@hookimpl(tryfirst=True)
def asyncflow_stores():
    yield StoreBackend(
        name="inprocess",
        factory=_make_inprocess,
        config_model=_config_model(),
        description="Controller and storage in the caller's process: the embedded default, no server.",
        features=INPROCESS_FEATURES,
    )
