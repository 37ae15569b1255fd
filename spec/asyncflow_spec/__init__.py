"""The asyncflow conformance suite.

A backend proves it honours its contract with one short test module::

    from asyncflow_spec import RolloutEngineSpec

    class TestMyEngine(RolloutEngineSpec):
        backend = "my-engine"
        options = {...}

or, for an installed plugin, ``asyncflow spec my-engine``.
"""

from asyncflow_core.plugins import PluginKind
from asyncflow_spec.algorithm import AlgorithmSpec
from asyncflow_spec.base import BackendSpec, expect_unsupported, forbid, require, run
from asyncflow_spec.dataset import DatasetSpec
from asyncflow_spec.environment import EnvironmentSpec
from asyncflow_spec.reward import RewardSpec
from asyncflow_spec.rollout import RolloutEngineSpec
from asyncflow_spec.sampler import SamplerSpec
from asyncflow_spec.stage import StageSpec
from asyncflow_spec.store import StoreSpec
from asyncflow_spec.train import TrainEngineSpec
from asyncflow_spec.transport import WeightTransportSpec

#: The spec class `asyncflow spec PLUGIN` runs for each kind.
SPEC_CLASSES: dict[PluginKind, type[BackendSpec]] = {
    PluginKind.ROLLOUT_ENGINE: RolloutEngineSpec,
    PluginKind.TRAIN_ENGINE: TrainEngineSpec,
    PluginKind.WEIGHT_TRANSPORT: WeightTransportSpec,
    PluginKind.ALGORITHM: AlgorithmSpec,
    PluginKind.REWARD: RewardSpec,
    PluginKind.DATASET: DatasetSpec,
    PluginKind.STAGE: StageSpec,
    PluginKind.ENVIRONMENT: EnvironmentSpec,
    PluginKind.SAMPLER: SamplerSpec,
}

__all__ = [
    "SPEC_CLASSES",
    "AlgorithmSpec",
    "BackendSpec",
    "DatasetSpec",
    "EnvironmentSpec",
    "RewardSpec",
    "RolloutEngineSpec",
    "SamplerSpec",
    "StageSpec",
    "StoreSpec",
    "TrainEngineSpec",
    "WeightTransportSpec",
    "expect_unsupported",
    "forbid",
    "require",
    "run",
]
