"""Standard column names. Stages, algorithms and stores agree on these.

Ragged columns hold one sequence per row; dense ones one value (or vector) per row.
Plugins may add columns of their own; these are the ones the built-ins use.

Episodes (multi-turn rollouts, asyncflow_core/flow/episode.py) write the
response columns over the whole episode after the prompt: the policy's
sampled turns and the observations between them (``loss_mask`` 0,
``behavior_logprobs`` 0). ``response_versions`` of an observed token carries
the version of the last token the policy sampled before it, so the minimum
over a row is the minimum over its sampled tokens (what the staleness bound
is checked on).
"""

import torch

PROMPT_IDS = "prompt_ids"  #: ragged int64: prompt token ids
RESPONSE_IDS = "response_ids"  #: ragged int64: generated token ids (an episode: sampled and observed tokens)
BEHAVIOR_LOGPROBS = "behavior_logprobs"  #: ragged float32: log-probs of response tokens under the sampling policy
RESPONSE_VERSIONS = "response_versions"  #: ragged int64: policy version that sampled each response token
OLD_LOGPROBS = "old_logprobs"  #: ragged float32: log-probs under the trainer's weights before the step (proximal policy)
REF_LOGPROBS = "ref_logprobs"  #: ragged float32: log-probs under the frozen reference policy
VALUES = "values"  #: ragged float32: value-head estimates per response token
REWARD = "reward"  #: dense float32 [n]: scalar reward per sample
#: dense float32 [n] per declared key: an extra value the reward returned beside ``reward`` (``correct``,
#: ``answer_found``, a combined reward's terms), NaN where a sample lacks it; a reward declares its keys in
#: ``RewardFeatures.extras`` and the reward stage writes one column per key (:func:`reward_extra`)
REWARD_EXTRA_PREFIX = "reward_extra/"


def reward_extra(key: str) -> str:
    """The store column of the reward's extra value ``key``."""
    return REWARD_EXTRA_PREFIX + key


ADVANTAGES = "advantages"  #: ragged float32: advantage per response token
RETURNS = "returns"  #: ragged float32: value targets per response token (PPO)
GROUP_ID = "group_id"  #: dense int64 [n]: prompt group a sample belongs to
LOGPROBS = "logprobs"  #: ragged float32: output of TrainEngine.compute_logprobs
FILTERED = "filtered"  #: dense bool [n]: an algorithm filters this sample out (dynamic sampling); its group is dropped
TRUNCATED = "truncated"  #: dense bool [n]: generation stopped at max_new_tokens (finish reason ``length``)
VALUE_PREDS = "value_preds"  #: ragged float32: value-head predictions with grad, put in micro-batches by the trainer
#: ragged bool or uint8, optional, aligned with response_ids: 1 = the loss applies to the token (the policy sampled
#: it), 0 = the token contributes nothing (prompt, observation, tool tokens). Absent: every response token counts.
LOSS_MASK = "loss_mask"
#: ragged int64, episodes, aligned with response_ids: the 0-based policy turn of each response token (an
#: observation belongs to the turn it answers); turn boundaries are where the value changes
TURN_IDS = "turn_ids"
TURN_REWARDS = "turn_rewards"  #: ragged float32, episodes: one reward per policy turn, as the environment returned it
EPISODE_TURNS = "episode_turns"  #: dense int64, episodes: policy turns taken
EPISODE_TOOL_CALLS = "episode_tool_calls"  #: dense int64, episodes: tool calls (the steps' ``info['tool_calls']``)
EPISODE_TOOL_OK = "episode_tool_ok"  #: dense int64, episodes: tool calls that succeeded (``info['tool_ok']``)
#: dense float32, episodes: seconds spent in the environment's reset and steps (the environment pool's own timing:
#: inside the worker process for environments that live in one)
EPISODE_ENV_S = "episode_env_s"
EPISODE_MASKED_FRAC = "episode_masked_frac"  #: dense float32, episodes: fraction of response tokens with loss mask 0
#: dense float32, episodes: seconds in tools (sum of the steps' ``info['tool_seconds']``); NaN when no step reported it
EPISODE_TOOL_S = "episode_tool_s"
#: dense float32, episodes: the last step's ``info['correct']`` (numeric); NaN when the environment did not report it
EPISODE_CORRECT = "episode_correct"

#: Kind (``"dense"`` or ``"ragged"``) and dtype of every standard column: what a placeholder for a failed row
#: is written in, and what the pipeline's column checks know.
STANDARD_COLUMN_TYPES: dict[str, tuple[str, torch.dtype]] = {
    PROMPT_IDS: ("ragged", torch.int64),
    RESPONSE_IDS: ("ragged", torch.int64),
    BEHAVIOR_LOGPROBS: ("ragged", torch.float32),
    RESPONSE_VERSIONS: ("ragged", torch.int64),
    OLD_LOGPROBS: ("ragged", torch.float32),
    REF_LOGPROBS: ("ragged", torch.float32),
    VALUES: ("ragged", torch.float32),
    REWARD: ("dense", torch.float32),
    ADVANTAGES: ("ragged", torch.float32),
    RETURNS: ("ragged", torch.float32),
    GROUP_ID: ("dense", torch.int64),
    LOGPROBS: ("ragged", torch.float32),
    FILTERED: ("dense", torch.bool),
    TRUNCATED: ("dense", torch.bool),
    VALUE_PREDS: ("ragged", torch.float32),
    LOSS_MASK: ("ragged", torch.bool),
    TURN_IDS: ("ragged", torch.int64),
    TURN_REWARDS: ("ragged", torch.float32),
    EPISODE_TURNS: ("dense", torch.int64),
    EPISODE_TOOL_CALLS: ("dense", torch.int64),
    EPISODE_TOOL_OK: ("dense", torch.int64),
    EPISODE_ENV_S: ("dense", torch.float32),
    EPISODE_MASKED_FRAC: ("dense", torch.float32),
    EPISODE_TOOL_S: ("dense", torch.float32),
    EPISODE_CORRECT: ("dense", torch.float32),
}

#: Ragged standard columns with one value per response token (their offsets are the response's).
PER_RESPONSE_TOKEN = frozenset({BEHAVIOR_LOGPROBS, RESPONSE_VERSIONS, OLD_LOGPROBS, REF_LOGPROBS, VALUES, ADVANTAGES,
                                RETURNS, LOGPROBS, VALUE_PREDS, LOSS_MASK, TURN_IDS})

#: The columns an episode writes beside the single-turn rollout's (``reward`` too when the environment owns it).
EPISODE_COLUMNS = (LOSS_MASK, TURN_IDS, TURN_REWARDS, EPISODE_TURNS, EPISODE_TOOL_CALLS, EPISODE_TOOL_OK,
                   EPISODE_ENV_S, EPISODE_MASKED_FRAC, EPISODE_TOOL_S, EPISODE_CORRECT)
