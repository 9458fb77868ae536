"""Core RL algorithm math: masked statistics, advantage estimators and PPO-style losses.

Estimators and policy losses are registered by name (registry.py) with what they need.
Everything in this package is a pure tensor function (no I/O, no distributed calls, no
host syncs beyond what ``torch.unique`` needs), so it can be unit-tested on CPU and reused
unchanged by any trainer or worker.
"""

from verl_hpc.algo import estimators as _builtin  # noqa: E402,F401 - registers grpo, gae, vanilla
from verl_hpc.algo.advantages import gae_advantages, grpo_advantages, token_level_rewards
from verl_hpc.algo.losses import (
    AGG_MODES,
    KL_KINDS,
    aggregate_loss,
    counted_rows,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from verl_hpc.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from verl_hpc.algo.registry import (
    ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    EstimatorSpec,
    get_estimator,
    get_policy_loss,
    register_estimator,
    register_policy_loss,
)

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "EstimatorSpec",
    "get_estimator",
    "get_policy_loss",
    "register_estimator",
    "register_policy_loss",
    "KL_KINDS",
    "aggregate_loss",
    "counted_rows",
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
