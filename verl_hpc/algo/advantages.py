"""Advantage estimators: group-relative (GRPO), token-level rewards and GAE.

Why two estimators:

* **GRPO** needs no critic. Each prompt is sampled several times and a response's
  advantage is its score relative to the other responses to the *same* prompt. The group
  statistics are computed with scatter/index_add over ``torch.unique`` inverse indices, so
  the cost is a handful of kernels regardless of batch size -- a Python loop over thousands
  of samples would dominate the step time and force host/device syncs.
* **GAE** (PPO with a critic) trades bias for variance with ``lam`` and needs per-token
  rewards, built by :func:`token_level_rewards` from the sequence score and an optional
  per-token KL penalty against the reference policy.

The GAE recursion *skips* masked positions (value and running advantage are carried over
them) instead of assuming a right-padded mask. For plain right padding this is identical
to the textbook formula with ``V = 0`` past the last valid token, and it stays correct for
multi-turn rollouts whose masks have holes where tool output was inserted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_hpc.algo.masked import masked_whiten

__all__ = ["grpo_advantages", "token_level_rewards", "gae_advantages"]


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Float dtype used for statistics: at least float32 (bf16/fp16/int are upcast)."""
    if x.dtype == torch.float64:
        return torch.float64
    return torch.float32


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages, broadcast over the response tokens.

    Args:
        scores: ``[B]`` scalar reward per response.
        group_ids: ``[B]`` int64 id of the prompt each response belongs to. Ids need not be
            contiguous, sorted or start at zero.
        response_mask: ``[B, R]`` 1 for generated tokens, 0 for padding.
        norm_by_std: divide by the group's (unbiased) standard deviation; when False only
            the group mean is subtracted (the "Dr. GRPO" variant).
        eps: added to the std to avoid dividing by zero for identical scores.

    Returns:
        ``(advantages, returns)``, both ``[B, R]`` and identical: GRPO has no critic, so the
        return target is the advantage itself. A group of size 1 has mean 0 and std 1, as in
        verl's `grpo` (and `grpo_vectorized`): its advantage is score / (1 + eps).
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError("scores and group_ids must both be 1-D tensors of the same length")
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError("response_mask must be [B, R] with B == len(scores)")
    dtype = _stat_dtype(scores)
    values = scores.to(dtype)
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()

    counts = torch.zeros(num_groups, dtype=dtype, device=values.device)
    counts.index_add_(0, inverse, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, inverse, values)
    is_single = counts <= 1
    # A lone sample has no group to compare with: mean 0 and std 1 (verl's `grpo`), so its
    # advantage is its own score.
    means = torch.where(is_single, torch.zeros_like(sums), sums / counts)
    centered = values - means[inverse]
    advantages = centered
    if norm_by_std:
        sq_sums = torch.zeros_like(counts).index_add_(0, inverse, centered**2)
        variances = sq_sums / torch.where(is_single, torch.ones_like(counts), counts - 1)
        stds = torch.where(is_single, torch.ones_like(counts), variances.sqrt())
        advantages = centered / (stds[inverse] + eps)
    token_adv = advantages.unsqueeze(-1) * response_mask.to(dtype)
    return token_adv, token_adv.clone()


def token_level_rewards(
    scores: Tensor,
    response_mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Spread sequence scores over tokens: score on the last valid token, minus a KL penalty.

    Args:
        scores: ``[B]`` sequence-level reward.
        response_mask: ``[B, R]`` 1 for generated tokens, 0 for padding.
        kl: optional ``[B, R]`` per-token KL estimate against the reference policy.
        kl_coef: weight of the KL penalty, applied on every valid token.

    Returns:
        ``[B, R]`` rewards, 0 on masked positions. A row with no valid token gets no reward.
    """
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError("response_mask must be [B, R] with B == len(scores)")
    dtype = _stat_dtype(scores)
    valid = response_mask != 0
    zero = torch.zeros((), dtype=dtype, device=scores.device)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
    is_last = positions.unsqueeze(0) == last.unsqueeze(1)
    rewards = torch.where(is_last, scores.to(dtype).unsqueeze(1), zero)
    if kl is not None and kl_coef != 0.0:
        penalty = torch.where(valid, kl.to(dtype), zero)
        rewards = rewards - kl_coef * penalty
    return rewards


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    computed backwards, where ``t+1`` means the next *valid* position and the successor of
    the last valid token has value 0 and advantage 0.

    Returns:
        ``(advantages, returns)``, both ``[B, R]`` and 0 on masked positions. ``returns`` is
        ``advantages + values`` computed before whitening (the critic's regression target);
        ``advantages`` are then masked-whitened over the batch if ``whiten``.
    """
    if not (token_rewards.shape == values.shape == response_mask.shape) or values.dim() != 2:
        raise ValueError("token_rewards, values and response_mask must all be [B, R]")
    dtype = _stat_dtype(values)
    valid = response_mask != 0
    zero = torch.zeros((), dtype=dtype, device=values.device)
    rewards = torch.where(valid, token_rewards.to(dtype), zero)
    vals = torch.where(valid, values.to(dtype), zero)

    batch, length = vals.shape
    next_value = torch.zeros(batch, dtype=dtype, device=vals.device)
    next_adv = torch.zeros_like(next_value)
    per_step: list[Tensor] = [next_value] * length
    for t in range(length - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        per_step[t] = adv_t
        step_valid = valid[:, t]
        next_value = torch.where(step_valid, vals[:, t], next_value)
        next_adv = torch.where(step_valid, adv_t, next_adv)

    advantages = torch.where(valid, torch.stack(per_step, dim=1), zero)
    returns = torch.where(valid, advantages + vals, zero)
    if whiten:
        advantages = masked_whiten(advantages, valid)
    return advantages, returns
