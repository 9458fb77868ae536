"""ReMax (Li et al., 2023, arXiv:2310.10505): REINFORCE with the greedy response as baseline.

Why a greedy baseline: it needs no critic and no second sample per prompt to be
informative; the score of the policy's own most likely answer says how good "the
policy as it stands" is on this prompt, and a sample is credited only for doing better.
The run generates one greedy response per prompt and scores it with the run's reward
(`greedy_baseline`); returns are the token rewards summed from each token to the end,
so a KL penalty in the reward (`kl.in_reward`) counts per token, as in verl.
"""

from __future__ import annotations

from torch import Tensor

from verl_hpc.algo.registry import AdvantageInputs, register_estimator


@register_estimator("remax", whole_groups=True, token_rewards=True, greedy_baseline=True)
def remax(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Return-to-go of the token rewards minus the score of the prompt's greedy response."""
    if inputs.baselines is None:
        raise ValueError("remax needs the greedy responses' scores (AdvantageInputs.baselines)")
    mask = (inputs.response_mask != 0).to(inputs.token_rewards.dtype)
    returns = (inputs.token_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = (returns - inputs.baselines.to(returns.dtype).unsqueeze(-1)) * mask
    return advantages, returns
