"""GSPO (Zheng et al., 2025, arXiv:2507.18071): one importance ratio per sequence, in its
GSPO-token form (as verl's `gspo` loss).

Why a sequence ratio: the reward is given to the whole response, so the off-policy
correction should be too. Token ratios multiply noise over long responses and, clipped
token by token, let single tokens dominate; GSPO's ratio is the geometric mean of the
token ratios, s = exp(mean_t (log pi - log pi_old)), clipped as a whole. That ratio is
much closer to 1 than a token ratio, hence the paper's tiny clip ranges (3e-4 / 4e-4, the
`gspo` preset's).

Why the token form: token t's ratio is s_{i,t} = sg[s_i] * pi_t / sg[pi_t], whose value is
s_i but whose gradient reaches only token t, weighted by its own advantage. With one
advantage per response (GRPO) this is GSPO exactly; with per-token advantages (GAE,
REINFORCE++) each token is credited with its own A_t instead of the response's average.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from verl_hpc.algo.losses import aggregate_loss
from verl_hpc.algo.masked import masked_mean
from verl_hpc.algo.registry import register_policy_loss

_LOG_RATIO_MAX = 10.0  # verl's clamp of the token-form log ratio: exp() stays finite


@register_policy_loss("gspo")
def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
         algo: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence ratio exp(mean token log-ratio) clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    valid = mask != 0
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    lengths = valid.sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (log_ratio.sum(dim=-1) / lengths).detach().unsqueeze(-1)  # [B, 1]
    own = torch.where(valid, logprobs, torch.zeros_like(logprobs))  # padding garbage never reaches exp()
    token_log_ratio = torch.clamp(own - own.detach() + seq_log_ratio, max=_LOG_RATIO_MAX)
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - algo.clip_ratio_low, 1.0 + algo.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, mask, algo.loss_agg_mode, algo.sampling.max_new_tokens)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), mask).detach(),
            "clipfrac_lower": torch.zeros((), dtype=per_token.dtype, device=per_token.device),
            "approx_kl": masked_mean(-log_ratio, mask).detach(),
        }
    return loss, stats
