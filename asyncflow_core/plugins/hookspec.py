"""The hook specifications: one hook per kind of thing a plugin can provide.

Hooks are synchronous, take no arguments and only *register*: each returns
an iterable of registration records. Work happens on the backend objects the
records' factories build. A plugin is a module (named by an entry point in the
``asyncflow`` group) holding ``@hookimpl`` functions.

The docstring of each hook is its reference documentation; docs/plugins.md
repeats every hook (a test keeps the two in sync).
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from asyncflow_core.plugins.types import (
    AlgorithmBackend,
    DatasetBackend,
    EnvironmentBackend,
    LauncherBackend,
    RewardBackend,
    RolloutEngineBackend,
    SamplerBackend,
    StageBackend,
    StoreBackend,
    TrainEngineBackend,
    WeightTransportBackend,
)

PROJECT_NAME = "asyncflow"
ENTRY_POINT_GROUP = "asyncflow"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class AsyncflowHookSpecs:
    """Every hook asyncflow calls."""

    @hookspec
    def asyncflow_rollout_engines(self) -> Iterable[RolloutEngineBackend]:
        """Register rollout (inference) engines.

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.interfaces import RolloutFeatures
            from asyncflow_core.plugins import RolloutEngineBackend, hookimpl

            class MyEngineConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                endpoint: str = Field("http://127.0.0.1:8000", description="Server to talk to.")

            def _make(config: MyEngineConfig):
                from my_package.engine import MyEngine  # heavy import only when used
                return MyEngine(config)

            @hookimpl
            def asyncflow_rollout_engines():
                yield RolloutEngineBackend(
                    name="my-engine",
                    factory=_make,
                    config_model=MyEngineConfig,
                    description="My inference server behind the RolloutEngine contract.",
                    features=RolloutFeatures(supports_abort=True, supports_pause_keep=True),
                )
        """

    @hookspec
    def asyncflow_train_engines(self) -> Iterable[TrainEngineBackend]:
        """Register training engines.

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.interfaces import TrainFeatures
            from asyncflow_core.plugins import TrainEngineBackend, hookimpl

            class MyTrainerConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                lr: float = Field(1e-6, description="Learning rate.")

            def _make(config: MyTrainerConfig):
                from my_package.trainer import MyTrainer
                return MyTrainer(config)

            @hookimpl
            def asyncflow_train_engines():
                yield TrainEngineBackend(
                    name="my-trainer",
                    factory=_make,
                    config_model=MyTrainerConfig,
                    description="Data-parallel trainer on my framework.",
                    features=TrainFeatures(supports_values=True),
                )
        """

    @hookspec
    def asyncflow_stores(self) -> Iterable[StoreBackend]:
        """Register streaming store deployments.

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.interfaces import StoreFeatures
            from asyncflow_core.plugins import StoreBackend, hookimpl

            class RedisStoreConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                socket: str = Field("/tmp/store.sock", description="Unix socket of the server.")

            def _make(config: RedisStoreConfig):
                from my_package.store import RedisStore
                return RedisStore(config)

            @hookimpl
            def asyncflow_stores():
                yield StoreBackend(
                    name="redis",
                    factory=_make,
                    config_model=RedisStoreConfig,
                    description="Rows kept in a local Redis server.",
                    features=StoreFeatures(deployment="multiprocess"),
                )
        """

    @hookspec
    def asyncflow_samplers(self) -> Iterable[SamplerBackend]:
        """Register samplers (which ready rows a ``get_meta`` call hands out).

        Example::

            import torch
            from asyncflow_core.interfaces import Sampler
            from asyncflow_core.plugins import SamplerBackend, hookimpl

            class Newest(Sampler):
                "Newest rows first."
                def __init__(self, config):
                    pass
                def sample(self, candidates, request):
                    n = len(candidates)
                    if n < request.batch_size and not request.partial:
                        return torch.empty(0, dtype=torch.int64)
                    return torch.arange(n - 1, max(n - request.batch_size, 0) - 1, -1)

            @hookimpl
            def asyncflow_samplers():
                yield SamplerBackend(name="newest", factory=Newest, description="Newest rows first.")
        """

    @hookspec
    def asyncflow_weight_transports(self) -> Iterable[WeightTransportBackend]:
        """Register weight transports (trainer -> rollout engines).

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.interfaces import TransportFeatures
            from asyncflow_core.plugins import WeightTransportBackend, hookimpl

            class RdmaConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                device: str = Field("mlx5_0", description="RDMA device.")

            def _make(config: RdmaConfig):
                from my_package.rdma import RdmaTransport
                return RdmaTransport(config)

            @hookimpl
            def asyncflow_weight_transports():
                yield WeightTransportBackend(
                    name="rdma",
                    factory=_make,
                    config_model=RdmaConfig,
                    description="One-sided RDMA writes into the engines' staging buffers.",
                    features=TransportFeatures(cross_process=True, cross_host=True, devices=("cuda",)),
                )
        """

    @hookspec
    def asyncflow_algorithms(self) -> Iterable[AlgorithmBackend]:
        """Register RL algorithms (advantage estimator + policy loss).

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.plugins import AlgorithmBackend, hookimpl

            class MyPGConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                clip: float = Field(0.2, description="PPO clip range.")

            def _make(config: MyPGConfig):
                from my_package.algo import MyPG
                return MyPG(config)

            @hookimpl
            def asyncflow_algorithms():
                yield AlgorithmBackend(
                    name="my-pg", factory=_make, config_model=MyPGConfig,
                    description="Clipped policy gradient with my baseline.",
                )
        """

    @hookspec
    def asyncflow_rewards(self) -> Iterable[RewardBackend]:
        """Register rewards (verifiers, reward models).

        Example::

            from asyncflow_core.interfaces import Reward
            from asyncflow_core.plugins import RewardBackend, hookimpl

            class Brevity(Reward):
                "1 for completions of at most 10 characters, else 0."
                def __init__(self, config):
                    pass
                def score(self, sample):
                    return float(len(sample.completion) <= 10)

            @hookimpl
            def asyncflow_rewards():
                yield RewardBackend(name="brevity", factory=Brevity, description="Rewards short answers.")
        """

    @hookspec
    def asyncflow_datasets(self) -> Iterable[DatasetBackend]:
        """Register prompt datasets.

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.interfaces import Dataset
            from asyncflow_core.plugins import DatasetBackend, hookimpl
            from asyncflow_core.types import PromptRecord

            class CountingConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                size: int = Field(100, description="Number of prompts.")

            class Counting(Dataset):
                def __init__(self, config: CountingConfig):
                    self.size = config.size
                def __len__(self):
                    return self.size
                def __getitem__(self, index):
                    if not 0 <= index < self.size:
                        raise IndexError(index)
                    return PromptRecord(index=index, prompt=f"Count to {index}:",
                                        metadata={"answer": " ".join(map(str, range(index + 1)))})

            @hookimpl
            def asyncflow_datasets():
                yield DatasetBackend(name="counting", factory=Counting, config_model=CountingConfig,
                                     description="Prompts asking to count to n.")
        """

    @hookspec
    def asyncflow_launchers(self) -> Iterable[LauncherBackend]:
        """Register launchers (how and where a run's roles start).

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.plugins import LauncherBackend, hookimpl

            class SlurmConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                partition: str = Field("gpu", description="Slurm partition to submit to.")

            def _make(config: SlurmConfig):
                from my_package.slurm import SlurmLauncher
                return SlurmLauncher(config)

            @hookimpl
            def asyncflow_launchers():
                yield LauncherBackend(name="slurm", factory=_make, config_model=SlurmConfig,
                                      description="One Slurm job step per role.")
        """

    @hookspec
    def asyncflow_stages(self) -> Iterable[StageBackend]:
        """Register pipeline stages that configs add by name (``pipeline.stages``) or swap in (``pipeline.replace``).

        A stage's factory returns a :class:`~asyncflow_core.flow.stage.Stage`:
        it declares the columns it ``consumes`` and ``produces`` and computes
        them in ``process``; the runtime leases, reads, writes and acknowledges.
        Every added stage runs on each sample before advantages are computed;
        returning ``drop`` filters samples (their prompt groups are dropped and
        counted as ``filtered``).

        Example::

            import torch
            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.flow.stage import Stage, StageOutput
            from asyncflow_core.plugins import StageBackend, hookimpl

            class LengthFilterConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                max_tokens: int = Field(4096, ge=1, description="Drop samples whose response is longer.")

            class LengthFilter(Stage):
                name = "length_filter"
                consumes = ("response_ids",)
                produces = ("too_long",)

                def __init__(self, config: LengthFilterConfig):
                    self.config = config

                async def process(self, batch):
                    too_long = batch["response_ids"].lengths > self.config.max_tokens
                    return StageOutput({"too_long": too_long.float()}, drop=too_long)

            @hookimpl
            def asyncflow_stages():
                yield StageBackend(name="length_filter", factory=LengthFilter, config_model=LengthFilterConfig,
                                   description="Drops samples whose response exceeds max_tokens.")
        """

    @hookspec
    def asyncflow_environments(self) -> Iterable[EnvironmentBackend]:
        """Register environments: multi-turn episodes in which the policy acts, calls tools and reads results.

        The factory receives the validated options and builds one fresh
        :class:`~asyncflow_core.interfaces.Environment`; the runtime calls it once per
        episode (``reset(record, seed=...)``, ``step(action)``, ``close()``).
        The runtime runs each call under ``environment.step_timeout_s``, in the
        event loop or, for ``features.blocking`` environments, in worker
        processes (``environment.processes``); an exception ends that episode as
        a recorded failure. Tools are written with
        :func:`asyncflow_plugins.envs.tools.tool` and served by
        :class:`asyncflow_plugins.envs.ToolEnvironment`.

        Example::

            from pydantic import BaseModel, ConfigDict, Field
            from asyncflow_core.interfaces import Environment, EnvironmentFeatures, Observation, Step
            from asyncflow_core.plugins import EnvironmentBackend, hookimpl

            class GuessConfig(BaseModel):
                model_config = ConfigDict(extra="forbid")
                secret: int = Field(7, ge=0, le=9, description="The digit to guess.")

            class Guess(Environment):
                "The policy guesses a digit; each wrong guess is answered 'higher' or 'lower'."
                features = EnvironmentFeatures(owns_reward=True)

                def __init__(self, config: GuessConfig):
                    self.secret = config.secret

                async def reset(self, record, *, seed):
                    return Observation(text="guess a digit:")

                async def step(self, action):
                    guess = action.text.strip()[:1]
                    if guess == str(self.secret):
                        return Step(None, reward=1.0, done=True, info={"turns": action.turn + 1})
                    hint = "higher" if guess.isdigit() and int(guess) < self.secret else "lower"
                    return Step(Observation(text=f" {hint}, again:"))

            @hookimpl
            def asyncflow_environments():
                yield EnvironmentBackend(
                    name="guess", factory=Guess, config_model=GuessConfig,
                    description="Guess a digit with higher/lower feedback each turn.",
                    features=EnvironmentFeatures(owns_reward=True),
                )
        """
