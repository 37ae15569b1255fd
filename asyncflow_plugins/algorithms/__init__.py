"""Built-in algorithms: ``grpo``, ``rloo``, ``reinforce_pp`` and ``ppo``.

One module per family; they share the option pieces in
:mod:`~asyncflow_plugins.algorithms.options` and the clipped policy loss in
:mod:`~asyncflow_plugins.algorithms.policy_loss`. docs/algorithms.md has the
formulas, options and required columns.
"""

from __future__ import annotations

from asyncflow_core.plugins import AlgorithmBackend, hookimpl
from asyncflow_plugins.algorithms.grpo import GRPO, GRPOConfig
from asyncflow_plugins.algorithms.options import FILTERED, TRUNCATED, VALUE_PREDS
from asyncflow_plugins.algorithms.policy_loss import PolicyGradientAlgorithm
from asyncflow_plugins.algorithms.ppo import PPO, PPOConfig
from asyncflow_plugins.algorithms.reinforce import ReinforcePP, ReinforcePPConfig
from asyncflow_plugins.algorithms.rloo import RLOO, RLOOConfig

__all__ = [
    "FILTERED",
    "GRPO",
    "PPO",
    "RLOO",
    "TRUNCATED",
    "VALUE_PREDS",
    "GRPOConfig",
    "PPOConfig",
    "PolicyGradientAlgorithm",
    "RLOOConfig",
    "ReinforcePP",
    "ReinforcePPConfig",
]


@hookimpl
def asyncflow_algorithms():
    yield AlgorithmBackend(
        name="grpo",
        factory=GRPO,
        config_model=GRPOConfig,
        description="GRPO: group-relative advantages (Dr. GRPO / DAPO options), clipped loss, off-policy correction.",
    )
    yield AlgorithmBackend(
        name="rloo",
        factory=RLOO,
        config_model=RLOOConfig,
        description="RLOO: leave-one-out group baseline, clipped loss, off-policy correction.",
    )
    yield AlgorithmBackend(
        name="reinforce_pp",
        factory=ReinforcePP,
        config_model=ReinforcePPConfig,
        description="REINFORCE++: token-level KL in the reward, batch-normalised returns, clipped loss.",
    )
    yield AlgorithmBackend(
        name="ppo",
        factory=PPO,
        config_model=PPOConfig,
        description="PPO: value head, GAE advantages, clipped policy and value losses (needs the values column).",
    )
