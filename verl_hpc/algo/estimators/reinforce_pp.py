"""REINFORCE++ (Hu et al., 2025, arXiv:2501.03262) and its group-baseline variant.

Why batch whitening instead of a critic or per-group std: the paper normalises returns
over the whole global batch, which is stable with few samples per prompt and does not
over-weight prompts whose rewards barely differ (GRPO's per-group std does). The batch
is spread over the trainer ranks, so its statistics go through `reduce_sum`
(`whiten_over_ranks`): one process and many agree.

The discounted return skips masked positions (the running return is carried over a hole,
as `gae_advantages` does), so multi-turn masks with tool output inside stay correct; for
plain right padding it is the textbook reverse cumulative sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_hpc.algo.estimators.gae import whiten_over_ranks
from verl_hpc.algo.estimators.groups import group_totals, sequence_rewards
from verl_hpc.algo.registry import AdvantageInputs, register_estimator


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over the valid tokens (t+1 = the next valid one); 0 elsewhere."""
    valid = response_mask != 0
    rewards = torch.where(valid, token_rewards.to(torch.float64), torch.zeros((), dtype=torch.float64))
    running = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)
    out = torch.zeros_like(rewards)
    for t in range(rewards.shape[1] - 1, -1, -1):
        step = rewards[:, t] + gamma * running
        running = torch.where(valid[:, t], step, running)
        out[:, t] = torch.where(valid[:, t], step, torch.zeros_like(step))
    return out


@register_estimator("reinforce_pp", token_rewards=True)
def reinforce_pp(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Discounted returns of the token rewards (KL per token allowed), whitened over the batch."""
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, inputs.algo.gamma)
    return whiten_over_ranks(returns, inputs.response_mask, inputs.reduce_sum), returns


@register_estimator("reinforce_pp_baseline", whole_groups=True, min_group_size=2, token_rewards=True)
def reinforce_pp_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Reward minus its prompt group's mean, on every token, then whitened over the batch."""
    mask = inputs.response_mask
    rewards = sequence_rewards(inputs.token_rewards, mask)
    totals, counts = group_totals(rewards, inputs.group_ids)
    means = torch.where(counts > 1, totals / counts, torch.zeros_like(totals))  # a lone sample: baseline 0 (verl)
    centered = (rewards - means).unsqueeze(-1) * (mask != 0).to(torch.float64)
    adv = whiten_over_ranks(centered, mask, inputs.reduce_sum)
    return adv, adv.clone()
