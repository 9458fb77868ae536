"""GAE (Schulman et al., 2016, arXiv:1506.02438) with batch whitening, as PPO uses it.

Why whitening is done here and not in `gae_advantages`: the batch is spread over the
trainer ranks, so its mean and variance are sums reduced over them. The variance is
the unbiased one, whatever the number of ranks: one process and eight must agree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_hpc.algo.advantages import gae_advantages
from verl_hpc.algo.registry import AdvantageInputs, Reducer, register_estimator


def whiten_over_ranks(x: Tensor, mask: Tensor, reduce_sum: Reducer, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid entries of every rank's rows (unbiased variance)."""
    valid = (mask != 0).to(torch.float64)
    xs = x.to(torch.float64) * valid
    stats = reduce_sum(torch.stack([xs.sum(), (xs * xs).sum(), valid.sum()]).cpu()).to(x.device)
    total, total_sq, count = stats[0], stats[1], stats[2]
    mean = total / count.clamp(min=1)
    var = (total_sq - count * mean * mean) / (count - 1).clamp(min=1)
    out = (x.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    return torch.where(valid != 0, out, torch.zeros_like(out)).to(x.dtype)


@register_estimator("gae", needs_critic=True, token_rewards=True)
def gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Critic values and token rewards through GAE(gamma, lam), whitened over the whole batch."""
    if inputs.values is None:
        raise ValueError("the gae estimator needs critic values")
    algo = inputs.algo
    adv, returns = gae_advantages(inputs.token_rewards, inputs.values, inputs.response_mask, algo.gamma, algo.lam,
                                  whiten=False)
    return whiten_over_ranks(adv, inputs.response_mask, inputs.reduce_sum), returns
