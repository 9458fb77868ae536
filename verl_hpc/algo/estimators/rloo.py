"""RLOO (Ahmadian et al., 2024, arXiv:2402.14740): each response against the mean of the
other responses to its prompt.

Why leave-one-out: the baseline of response i must not depend on response i, or the
gradient estimate is biased; the mean of the other k - 1 rewards is the cheapest such
baseline and needs no critic. The reward is the row's token rewards summed, so a KL
penalty in the reward (`algorithm.kl.in_reward`, as the paper uses) is part of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_hpc.algo.estimators.groups import group_totals, sequence_rewards
from verl_hpc.algo.registry import AdvantageInputs, register_estimator


@register_estimator("rloo", whole_groups=True, min_group_size=2, token_rewards=True)
def rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Leave-one-out: reward minus the mean reward of the other samples of its prompt."""
    rewards = sequence_rewards(inputs.token_rewards, inputs.response_mask)
    totals, counts = group_totals(rewards, inputs.group_ids)
    others = (counts - 1).clamp(min=1)
    # A lone sample has no other to compare with: baseline 0, so its advantage is its reward, as in
    # verl's `rloo` (verl's `rloo_vectorized` gives 0; validation asks for n >= 2 anyway).
    adv = torch.where(counts > 1, rewards - (totals - rewards) / others, rewards)
    token_adv = adv.unsqueeze(-1) * (inputs.response_mask != 0).to(torch.float64)
    return token_adv, token_adv.clone()
