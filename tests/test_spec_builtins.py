"""The conformance suite against the built-in reference backends, in-tree."""

import pytest

from asyncflow_spec import AlgorithmSpec, DatasetSpec, RewardSpec, RolloutEngineSpec, TrainEngineSpec, WeightTransportSpec

from pathlib import Path

EXAMPLE_DATA = str(Path(__file__).parents[1] / "examples" / "data" / "toy_prompts.jsonl")


class TestToyRollout(RolloutEngineSpec):
    backend = "toy"
    options = {"vocab_size": 16}

    def weights(self):
        from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table

        return {PARAM_NAME: initial_table(16, seed=1, init_scale=1.0)}


class TestToyTrain(TrainEngineSpec):
    backend = "toy"
    options = {"vocab_size": 16}


class TestInProcessTransport(WeightTransportSpec):
    backend = "inprocess"


class TestGRPO(AlgorithmSpec):
    backend = "grpo"


class TestGRPODecoupled(AlgorithmSpec):
    backend = "grpo"
    options = {"correction": "decoupled", "normalize_std": False}


class TestExactMatch(RewardSpec):
    backend = "exact_match"


class TestJsonl(DatasetSpec):
    backend = "jsonl"
    options = {"path": EXAMPLE_DATA}
