"""The ``sim`` engines: simulated rollout, train and weight-transport backends on a virtual clock.

They run the real flow runtime and the real store with calibrated latency
models (:mod:`asyncflow_plugins.sim.latency`, explained in docs/simulation.md)
so scheduling at 1,024-device scale can be studied on a laptop. Run them on
:func:`asyncflow_core.flow.clock.run_virtual` to skip the waiting; on a real
event loop they sleep the modelled time multiplied by ``time_scale``.
"""

from __future__ import annotations

from asyncflow_core.plugins import (
    DatasetBackend,
    RewardBackend,
    RolloutEngineBackend,
    TrainEngineBackend,
    WeightTransportBackend,
    hookimpl,
)


def _make_rollout(config):
    from asyncflow_plugins.sim.rollout import SimRolloutEngine

    return SimRolloutEngine(config)


def _make_train(config):
    from asyncflow_plugins.sim.train import SimTrainEngine

    return SimTrainEngine(config)


def _make_transport(config):
    from asyncflow_plugins.sim.transport import SimWeightTransport

    return SimWeightTransport(config)


@hookimpl
def asyncflow_rollout_engines():
    from asyncflow_plugins.sim.rollout import FEATURES, SimRolloutConfig

    yield RolloutEngineBackend(
        name="sim",
        factory=_make_rollout,
        config_model=SimRolloutConfig,
        description="Simulated inference replica: event-driven continuous batching with a calibrated latency model.",
        features=FEATURES,
    )


@hookimpl
def asyncflow_train_engines():
    from asyncflow_plugins.sim.train import FEATURES, SimTrainConfig

    yield TrainEngineBackend(
        name="sim",
        factory=_make_train,
        config_model=SimTrainConfig,
        description="Simulated trainer group: each step costs 6 x params x tokens / (devices x peak x MFU).",
        features=FEATURES,
    )


@hookimpl
def asyncflow_weight_transports():
    from asyncflow_plugins.sim.transport import FEATURES, SimTransportConfig

    yield WeightTransportBackend(
        name="sim",
        factory=_make_transport,
        config_model=SimTransportConfig,
        description="Simulated weight transfer: tiny real buckets, model_bytes / bandwidth of loop time.",
        features=FEATURES,
    )


@hookimpl
def asyncflow_datasets():
    from asyncflow_plugins.sim.workload import SimDataset, SimDatasetConfig

    yield DatasetBackend(
        name="sim",
        factory=SimDataset,
        config_model=SimDatasetConfig,
        description="Synthetic prompts: lognormal lengths, random token ids (for simulated runs).",
    )


@hookimpl
def asyncflow_rewards():
    from asyncflow_plugins.sim.workload import SimReward, SimRewardConfig

    yield RewardBackend(
        name="sim",
        factory=SimReward,
        config_model=SimRewardConfig,
        description="Bernoulli(p_correct) reward, deterministic per sample; reads no text (for simulated runs).",
    )
