"""Per-prompt-group sums for the group-baseline estimators (RLOO, REINFORCE++-baseline).

Why a helper: both estimators need each row's group total and group size, computed with
index_add over `torch.unique`'s inverse indices (a handful of kernels for any batch size,
no Python loop over rows). Rows of a group are on one rank (`whole_groups`), so no
reduction over ranks is needed here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sequence_rewards(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """A row's reward: its token rewards summed (the score, minus the KL when it is in the reward)."""
    valid = response_mask != 0
    return torch.where(valid, token_rewards.to(torch.float64), torch.zeros((), dtype=torch.float64)).sum(dim=-1)


def group_totals(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of `values` over the row's group, size of the row's group), both `[B]` float64."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    values = values.to(torch.float64)
    sums = torch.zeros(unique.numel(), dtype=torch.float64, device=values.device)
    counts = torch.zeros_like(sums)
    sums.index_add_(0, inverse, values)
    counts.index_add_(0, inverse, torch.ones_like(values))
    return sums[inverse], counts[inverse]
