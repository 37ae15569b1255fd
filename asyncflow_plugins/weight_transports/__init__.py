"""Verified weight transports that cross process boundaries: ``shm``, ``dist`` and ``disk``.

Each one carries a JSON manifest (:mod:`.manifest`) with every bucket's
checksum and checks on arrival that a whole version came and that every
bucket matches before yielding any. They are registered by the ``inprocess``
transport's hook in :mod:`asyncflow_plugins.transports`; docs/weight-transports.md
explains options, verification and the process model.
"""

from __future__ import annotations

from asyncflow_core.interfaces import TransportFeatures
from asyncflow_core.plugins import WeightTransportBackend
from asyncflow_plugins.weight_transports.config import (
    DiskTransportConfig,
    DistTransportConfig,
    ShmTransportConfig,
)


def _make_shm(config: ShmTransportConfig):
    from asyncflow_plugins.weight_transports.shm import ShmWeightTransport

    return ShmWeightTransport(config)


def _make_dist(config: DistTransportConfig):
    from asyncflow_plugins.weight_transports.dist import DistWeightTransport

    device = config.device
    if device is not None and device.isdigit():
        device = int(device)
    return DistWeightTransport(config, device=device)


def _make_disk(config: DiskTransportConfig):
    from asyncflow_plugins.weight_transports.disk import DiskWeightTransport

    return DiskWeightTransport(config)


def registrations() -> list[WeightTransportBackend]:
    """The records of the three transports (yielded by the built-in transports hook)."""
    return [
        WeightTransportBackend(
            name="shm",
            factory=_make_shm,
            config_model=ShmTransportConfig,
            description="Local processes: a version staged in double-buffered shared memory, mapped and verified.",
            features=TransportFeatures(cross_process=True, cross_host=False, devices=("cpu",)),
        ),
        WeightTransportBackend(
            name="dist",
            factory=_make_dist,
            config_model=DistTransportConfig,
            description="torch.distributed broadcast (gloo on CPU, NCCL on GPU) from a source rank, announced first.",
            features=TransportFeatures(cross_process=True, cross_host=False, devices=("cpu", "cuda")),
        ),
        WeightTransportBackend(
            name="disk",
            factory=_make_disk,
            config_model=DiskTransportConfig,
            description="Safetensors files plus a JSON manifest per version, renamed into place; receivers poll.",
            features=TransportFeatures(cross_process=True, cross_host=False, devices=("cpu",)),
        ),
    ]
