"""Standard column names. Stages, algorithms and stores agree on these.

Ragged columns hold one sequence per row; dense ones one value (or vector) per row.
Plugins may add columns of their own; these are the ones the built-ins use.
"""

PROMPT_IDS = "prompt_ids"  #: ragged int64: prompt token ids
RESPONSE_IDS = "response_ids"  #: ragged int64: generated token ids
BEHAVIOR_LOGPROBS = "behavior_logprobs"  #: ragged float32: log-probs of response tokens under the sampling policy
RESPONSE_VERSIONS = "response_versions"  #: ragged int64: policy version that sampled each response token
OLD_LOGPROBS = "old_logprobs"  #: ragged float32: log-probs under the trainer's weights before the step (proximal policy)
REF_LOGPROBS = "ref_logprobs"  #: ragged float32: log-probs under the frozen reference policy
VALUES = "values"  #: ragged float32: value-head estimates per response token
REWARD = "reward"  #: dense float32 [n]: scalar reward per sample
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
