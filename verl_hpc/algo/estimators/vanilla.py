"""The clipped PPO surrogate (Schulman et al., 2017, arXiv:1707.06347), registered as `vanilla`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from verl_hpc.algo.losses import policy_loss
from verl_hpc.algo.registry import register_policy_loss


@register_policy_loss("vanilla")
def vanilla(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
            algo: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """Token ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, algo.clip_ratio_low, algo.clip_ratio_high,
                       algo.loss_agg_mode, algo.sampling.max_new_tokens)
