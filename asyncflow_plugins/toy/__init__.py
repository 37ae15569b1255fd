"""The ``toy`` engines: a bigram policy behind the RolloutEngine and TrainEngine contracts.

Reference backends for the conformance suite and for runs that must finish in
seconds on a CPU. Start both with the same ``seed`` and ``vocab_size`` so
version 0 is the same policy on both sides.
"""

from __future__ import annotations

from asyncflow_core.plugins import RolloutEngineBackend, TrainEngineBackend, hookimpl


def _rollout_config():
    from asyncflow_plugins.toy.rollout import ToyRolloutConfig

    return ToyRolloutConfig


def _train_config():
    from asyncflow_plugins.toy.train import ToyTrainConfig

    return ToyTrainConfig


def _make_rollout(config):
    from asyncflow_plugins.toy.rollout import ToyRolloutEngine

    return ToyRolloutEngine(config)


def _make_train(config):
    from asyncflow_plugins.toy.train import ToyTrainEngine

    return ToyTrainEngine(config)


@hookimpl
def asyncflow_rollout_engines():
    from asyncflow_plugins.toy.rollout import FEATURES

    yield RolloutEngineBackend(
        name="toy",
        factory=_make_rollout,
        config_model=_rollout_config(),
        description="Bigram policy sampled on the CPU; reference backend for tests and the spec suite.",
        features=FEATURES,
    )


@hookimpl
def asyncflow_train_engines():
    from asyncflow_plugins.toy.train import FEATURES

    yield TrainEngineBackend(
        name="toy",
        factory=_make_train,
        config_model=_train_config(),
        description="Bigram policy trained with Adam on the CPU; reference backend for tests and the spec suite.",
        features=FEATURES,
    )
