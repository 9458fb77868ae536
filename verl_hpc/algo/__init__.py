"""Core RL algorithm math: masked statistics, advantage estimators and PPO-style losses.

Everything in this package is a pure tensor function (no I/O, no distributed calls, no
host syncs beyond what ``torch.unique`` needs), so it can be unit-tested on CPU and reused
unchanged by any trainer or worker.
"""

from verl_hpc.algo.advantages import gae_advantages, grpo_advantages, token_level_rewards
from verl_hpc.algo.losses import (
    AGG_MODES,
    KL_KINDS,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from verl_hpc.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "aggregate_loss",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "token_level_rewards",
    "value_loss",
]
