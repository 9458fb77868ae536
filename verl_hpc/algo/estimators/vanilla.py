"""The dual-clip PPO surrogate (Schulman et al., 2017, arXiv:1707.06347; Ye et al., 2020,
arXiv:1912.09729), registered as `vanilla`, as verl's loss of that name."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from verl_hpc.algo.losses import policy_loss
from verl_hpc.algo.registry import register_policy_loss

DEFAULT_CLIP_RATIO_C = 3.0  # verl's default; an `algo` without the field (a plugin's test double) gets it


@register_policy_loss("vanilla")
def vanilla(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
            algo: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """Token ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; A < 0 capped at -A * clip_ratio_c."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, algo.clip_ratio_low, algo.clip_ratio_high,
                       algo.loss_agg_mode, algo.sampling.max_new_tokens,
                       getattr(algo, "clip_ratio_c", DEFAULT_CLIP_RATIO_C))
