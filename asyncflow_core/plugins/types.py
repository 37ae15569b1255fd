"""Registration records: what a hook returns for each thing a plugin provides.

Records are small frozen dataclasses. ``factory`` is called with the
validated config model instance and returns the backend object; keep heavy
imports inside the factory so discovery stays cheap.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from asyncflow_core.errors import PluginError
from asyncflow_core.interfaces.environment import EnvironmentFeatures
from asyncflow_core.interfaces.features import (
    Features,
    RolloutFeatures,
    StoreFeatures,
    TrainFeatures,
    TransportFeatures,
)


class PluginKind(str, enum.Enum):
    """The kinds of thing a plugin can register; one hook each."""

    ROLLOUT_ENGINE = "rollout_engine"
    TRAIN_ENGINE = "train_engine"
    STORE = "store"
    SAMPLER = "sampler"
    WEIGHT_TRANSPORT = "weight_transport"
    ALGORITHM = "algorithm"
    REWARD = "reward"
    DATASET = "dataset"
    LAUNCHER = "launcher"
    STAGE = "stage"
    ENVIRONMENT = "environment"

    @property
    def hook_name(self) -> str:
        """Name of the hook that registers this kind (e.g. ``asyncflow_rollout_engines``)."""
        return f"asyncflow_{self.value}s"


class NoOptions(BaseModel):
    """Config model of a plugin that takes no options."""

    model_config = ConfigDict(extra="forbid")


_NAME = re.compile(r"^[a-z][a-z0-9_\-.]*$")


@dataclass(frozen=True)
class Registration:
    """Fields every record has.

    - ``name``: what configs use to pick it (lowercase, ``[a-z0-9_.-]``).
    - ``factory``: ``factory(config) -> backend``; ``config`` is an instance of ``config_model``.
    - ``config_model``: pydantic model validating the ``options`` of its config section.
    - ``description``: one line shown by ``asyncflow plugins``.
    """

    kind: ClassVar[PluginKind]

    name: str
    factory: Callable[[Any], Any]
    config_model: type[BaseModel] = NoOptions
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise PluginError(
                f"invalid {self.kind.value} name {self.name!r}: use lowercase letters, digits, '_', '-' or '.', "
                "starting with a letter"
            )
        if not callable(self.factory):
            raise PluginError(f"{self.kind.value} {self.name!r}: factory must be callable, got {self.factory!r}")
        if not (isinstance(self.config_model, type) and issubclass(self.config_model, BaseModel)):
            raise PluginError(f"{self.kind.value} {self.name!r}: config_model must be a pydantic BaseModel subclass")

    @property
    def declared_features(self) -> Features | None:
        """Capabilities declared at registration (for listing without building the backend)."""
        return getattr(self, "features", None)


@dataclass(frozen=True)
class RolloutEngineBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.RolloutEngine`."""

    kind: ClassVar[PluginKind] = PluginKind.ROLLOUT_ENGINE
    features: RolloutFeatures = field(default_factory=RolloutFeatures)


@dataclass(frozen=True)
class TrainEngineBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.TrainEngine`."""

    kind: ClassVar[PluginKind] = PluginKind.TRAIN_ENGINE
    features: TrainFeatures = field(default_factory=TrainFeatures)


@dataclass(frozen=True)
class StoreBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.StreamStore` deployment."""

    kind: ClassVar[PluginKind] = PluginKind.STORE
    features: StoreFeatures = field(default_factory=StoreFeatures)


@dataclass(frozen=True)
class SamplerBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.Sampler`."""

    kind: ClassVar[PluginKind] = PluginKind.SAMPLER


@dataclass(frozen=True)
class WeightTransportBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.WeightTransport`."""

    kind: ClassVar[PluginKind] = PluginKind.WEIGHT_TRANSPORT
    features: TransportFeatures = field(default_factory=TransportFeatures)


@dataclass(frozen=True)
class AlgorithmBackend(Registration):
    """Registers an :class:`~asyncflow_core.interfaces.Algorithm`."""

    kind: ClassVar[PluginKind] = PluginKind.ALGORITHM


@dataclass(frozen=True)
class RewardBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.Reward`."""

    kind: ClassVar[PluginKind] = PluginKind.REWARD


@dataclass(frozen=True)
class DatasetBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.Dataset`."""

    kind: ClassVar[PluginKind] = PluginKind.DATASET


@dataclass(frozen=True)
class LauncherBackend(Registration):
    """Registers a :class:`~asyncflow_core.interfaces.Launcher`."""

    kind: ClassVar[PluginKind] = PluginKind.LAUNCHER


@dataclass(frozen=True)
class StageBackend(Registration):
    """Registers a flow-runtime stage (a :class:`~asyncflow_core.flow.stage.Stage` subclass instance per run)."""

    kind: ClassVar[PluginKind] = PluginKind.STAGE


@dataclass(frozen=True)
class EnvironmentBackend(Registration):
    """Registers an environment (multi-turn episodes, tools).

    ``factory(config)`` builds one fresh :class:`~asyncflow_core.interfaces.Environment`; the runtime calls it
    once per episode (keep it cheap: cache what episodes share, acquire per-episode resources in ``reset``).
    To run in worker processes (``environment.processes``), environments are built there from the plugin
    name and options, so ``factory`` itself need not pickle. ``features`` are declared here so that
    listings and the runtime know them without building an environment.
    """

    kind: ClassVar[PluginKind] = PluginKind.ENVIRONMENT
    features: EnvironmentFeatures = field(default_factory=EnvironmentFeatures)


RECORD_TYPES: dict[PluginKind, type[Registration]] = {
    PluginKind.ROLLOUT_ENGINE: RolloutEngineBackend,
    PluginKind.TRAIN_ENGINE: TrainEngineBackend,
    PluginKind.STORE: StoreBackend,
    PluginKind.SAMPLER: SamplerBackend,
    PluginKind.WEIGHT_TRANSPORT: WeightTransportBackend,
    PluginKind.ALGORITHM: AlgorithmBackend,
    PluginKind.REWARD: RewardBackend,
    PluginKind.DATASET: DatasetBackend,
    PluginKind.LAUNCHER: LauncherBackend,
    PluginKind.STAGE: StageBackend,
    PluginKind.ENVIRONMENT: EnvironmentBackend,
}


@dataclass(frozen=True)
class Registered:
    """A record as discovered: plus which plugin and distribution provided it."""

    record: Registration
    plugin: str  #: plugin name (entry-point name, or module name for built-ins)
    distribution: str  #: providing distribution
    version: str  #: its version

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def kind(self) -> PluginKind:
        return self.record.kind
