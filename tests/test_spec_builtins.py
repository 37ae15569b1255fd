"""The conformance suite against the built-in reference backends, in-tree."""

import torch

from asyncflow_spec import (
    AlgorithmSpec,
    DatasetSpec,
    RewardSpec,
    RolloutEngineSpec,
    SamplerSpec,
    TrainEngineSpec,
    WeightTransportSpec,
)

from pathlib import Path

EXAMPLE_DATA = str(Path(__file__).parents[1] / "examples" / "data" / "toy_prompts.jsonl")


class TestToyRollout(RolloutEngineSpec):
    """The toy engine's policy is a bigram table: the suite's oracle is ``reference_logprobs`` over that table."""

    backend = "toy"
    options = {"vocab_size": 16}
    vocab_size = 16
    paired_trainer = "toy"
    paired_trainer_options = {"vocab_size": 16, "seed": 5}
    held_new_tokens = 200  # the toy engine decodes in lock-step: a pause lands at the next step

    def weights(self):
        from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table

        return {PARAM_NAME: initial_table(16, seed=1, init_scale=1.0)}

    def reference_logprobs(self, prompt, completion, sampling, *, weights):
        """``logits[next] = W[prev]`` under the shared convention; W is the engine's seed-0 table until an update."""
        from asyncflow_core.types.sampling import sampling_logprobs
        from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table

        table = weights[PARAM_NAME] if weights is not None else initial_table(16, seed=0, init_scale=1.0)
        prev = torch.tensor([prompt[-1], *completion[:-1]])
        logp = sampling_logprobs(table.double()[prev], sampling.temperature, sampling.top_p, sampling.top_k)
        return logp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


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


class TestFifoSampler(SamplerSpec):
    backend = "fifo"


class TestGroupSampler(SamplerSpec):
    backend = "group"


class TestTokenBalancedSampler(SamplerSpec):
    backend = "token_balanced"


class TestSimilarLengthSampler(SamplerSpec):
    backend = "similar_length"

