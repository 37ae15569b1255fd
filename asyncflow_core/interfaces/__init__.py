"""The contracts every backend implements.

Small, all-abstract classes; methods that do work are async. The docstrings
are the contract: what each method must do, what it may raise, and what
ordering it guarantees. Optional capabilities are declared in a ``Features``
model and checked by the conformance suite (``asyncflow-spec``).
"""

from asyncflow_core.interfaces.algorithm import Algorithm, LossContext, OffPolicyCorrection
from asyncflow_core.interfaces.dataset import Dataset
from asyncflow_core.interfaces.environment import (
    Action,
    Environment,
    EnvironmentFactory,
    EnvironmentFeatures,
    Observation,
    Step,
    ToolSpec,
)
from asyncflow_core.interfaces.features import (
    Features,
    RolloutFeatures,
    StoreFeatures,
    TrainFeatures,
    TransportFeatures,
)
from asyncflow_core.interfaces.launcher import Launcher
from asyncflow_core.interfaces.reward import Reward
from asyncflow_core.interfaces.rollout import Health, KVCachePolicy, PauseMode, RolloutEngine
from asyncflow_core.interfaces.sampler import Candidates, Sampler, SampleRequest
from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.interfaces.train import TrainEngine
from asyncflow_core.interfaces.transport import StagedVersion, TransferReport, WeightTransport, check_whole_version

__all__ = [
    "Action",
    "Algorithm",
    "BatchMeta",
    "Candidates",
    "Dataset",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentFeatures",
    "Features",
    "Health",
    "KVCachePolicy",
    "Launcher",
    "LossContext",
    "Observation",
    "OffPolicyCorrection",
    "PauseMode",
    "Reward",
    "RolloutEngine",
    "RolloutFeatures",
    "SampleRequest",
    "Sampler",
    "StagedVersion",
    "Step",
    "StoreFeatures",
    "StreamStore",
    "TrainEngine",
    "ToolSpec",
    "TrainFeatures",
    "TransferReport",
    "TransportFeatures",
    "WeightTransport",
    "check_whole_version",
]
