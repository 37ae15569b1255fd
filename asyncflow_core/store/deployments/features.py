"""What each store deployment declares it can do: one definition each.

The stores (:mod:`asyncflow_core.store.inprocess`, :mod:`.multiprocess`,
:mod:`.distributed`, :mod:`.ray_store`) answer ``features`` with these, and
the plugins (:mod:`asyncflow_core.store.plugin`, :mod:`.plugin`) register
them. This module imports only the features model, so registering a
deployment never loads its store, and a store never imports its registration.
"""

from __future__ import annotations

from asyncflow_core.interfaces.features import StoreFeatures

INPROCESS_FEATURES = StoreFeatures(deployment="inprocess", zero_copy_get=False, supports_checkpoint=True)
MULTIPROCESS_FEATURES = StoreFeatures(deployment="multiprocess", zero_copy_get=False, supports_checkpoint=True)
DISTRIBUTED_FEATURES = StoreFeatures(deployment="distributed", zero_copy_get=False, supports_checkpoint=True)
RAY_FEATURES = StoreFeatures(deployment="ray", zero_copy_get=False, supports_checkpoint=True)

__all__ = ["DISTRIBUTED_FEATURES", "INPROCESS_FEATURES", "MULTIPROCESS_FEATURES", "RAY_FEATURES"]
