"""Policy/value losses, KL estimators and logit utilities for PPO-style training.

Why these defaults:

* **token-mean aggregation** is the default because every valid token then carries the
  same weight, independent of how long its sequence is. Averaging per sequence first
  ("seq-mean-*") up-weights tokens of short responses and, for long chain-of-thought
  outputs, systematically under-trains long (often the hard, correct) answers. The other
  modes are kept for reproducing published recipes.
* **k3 KL estimator** (``exp(ref - logp) - (ref - logp) - 1``) is unbiased for
  KL(pi || ref) when tokens are sampled from pi, is always non-negative and has much lower
  variance than k1, which can go negative per token. It explodes when the log-ratio is large,
  hence the clamp.
* **Asymmetric clipping** (``clip_low`` / ``clip_high``) lets low-probability tokens grow
  more than they may shrink ("clip-higher"), which counters entropy collapse.
* **Dual clip** (Ye et al., 2020, arXiv:1912.09729; verl's ``clip_ratio_c``, default 3): the
  pessimistic PPO loss of a token with a negative advantage grows without bound with its
  ratio; capping it at ``-A * clip_ratio_c`` keeps one stale, very off-policy token from
  dominating the step.
* Log-ratios are clamped to ``[-20, 20]`` before ``exp`` so garbage or extreme values can
  never produce ``inf`` (and ``0 * inf = NaN`` gradients). Within that range results are exact.

All functions are pure; statistics are returned as detached scalar tensors so callers can
batch their transfer to the host instead of syncing once per metric.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_hpc.algo.masked import masked_mean, masked_sum

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "aggregate_loss",
    "counted_rows",
    "policy_loss",
    "kl_penalty",
    "entropy_from_logits",
    "logprobs_from_logits",
    "value_loss",
]

AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                               "seq-mean-token-sum-norm")
# verl's names: kl = k1, mse = k2, low_var_kl = k3; a trailing "+" keeps the value and takes k2's gradient.
_KL_BASE: dict[str, str] = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3",
                            "low_var_kl": "k3"}
KL_KINDS: tuple[str, ...] = (*_KL_BASE, *(f"{name}+" for name in _KL_BASE))
_LOG_RATIO_LIMIT = 20.0
_K3_LIMIT = 10.0


def counted_rows(mask: Tensor) -> Tensor:
    """Rows with at least one valid token: the rows a `seq-mean-*` mode averages over (as verl)."""
    return (mask != 0).any(dim=-1)


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str, norm_length: float | None = None) -> Tensor:
    """Reduce a ``[B, R]`` per-token loss to a scalar over the valid tokens (verl's `agg_loss`).

    Modes:
        ``token-mean``: sum over all valid tokens / number of valid tokens.
        ``token-sum``: sum over all valid tokens (the step grows with the batch's tokens).
        ``seq-mean-token-mean``: mean over the valid tokens of each sequence, then mean
        over sequences.
        ``seq-mean-token-sum``: sum over the valid tokens of each sequence, then mean over
        sequences.
        ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv:2503.20783): ``seq-mean-token-sum``
        divided by the constant ``norm_length`` (the response length cap,
        ``algorithm.sampling.max_new_tokens``; verl's default `loss_scale_factor`, the padded
        response width). The divisor is the same for every sequence and every step, so no
        response is up- or down-weighted by its length.

    In every ``seq-mean-*`` mode a sequence without any valid token is left out of the
    mean (verl 0.9.1 does the same), so an empty row does not dilute the loss; a
    micro-batch's share of the mean is its share of such counted rows
    (``roles.actor.micro_weight``). An all-masked input gives 0.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {mode!r}; valid modes are {', '.join(AGG_MODES)}")
    if loss_mat.dim() != 2 or mask.shape != loss_mat.shape:
        raise ValueError("loss_mat and mask must both be [B, R]")
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    loss = masked_mean(per_seq, counted_rows(mask))
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (the max response length)")
        loss = loss / norm_length
    return loss


def _clamped_log_ratio(logp: Tensor, base_logp: Tensor) -> Tensor:
    """``logp - base_logp`` clamped so that ``exp`` of it stays finite."""
    return torch.clamp(logp - base_logp, min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO surrogate loss, verl's `vanilla` (``norm_length``: see `aggregate_loss`).

    Per token: ``l = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with
    ``r = exp(logprobs - old_logprobs)``; where ``A < 0`` it is further capped,
    ``min(l, -A * clip_ratio_c)``; then aggregated with ``agg_mode``.

    Returns:
        ``(loss, stats)``; ``stats`` holds detached scalars ``clipfrac`` (fraction of valid
        tokens where the clipped term is strictly larger, i.e. active and gradient-free),
        ``clipfrac_lower`` (tokens with ``A < 0`` whose loss the dual clip capped) and
        ``approx_kl`` (mean of ``old_logprobs - logprobs`` over valid tokens).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (the dual clip's ratio bound), got {clip_ratio_c}")
    log_ratio = _clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pessimistic = torch.maximum(unclipped, clipped)
    capped = torch.minimum(pessimistic, -advantages * clip_ratio_c)
    negative = advantages < 0
    per_token = torch.where(negative, capped, pessimistic)
    loss = aggregate_loss(per_token, mask, agg_mode, norm_length)
    with torch.no_grad():
        dtype = per_token.dtype
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(dtype), mask).detach(),
            "clipfrac_lower": masked_mean((negative & (pessimistic > -advantages * clip_ratio_c)).to(dtype),
                                          mask).detach(),
            "approx_kl": masked_mean(-log_ratio, mask).detach(),
        }
    return loss, stats


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token log-probabilities.

    ``k1`` (verl: ``kl``): ``logp - ref`` (unbiased, high variance, can be negative).
    ``abs``: ``|logp - ref|``.
    ``k2`` (``mse``): ``0.5 * (logp - ref)^2`` (biased, low variance; its gradient matches the KL's).
    ``k3`` (``low_var_kl``): ``exp(ref - logp) - (ref - logp) - 1`` with the log-ratio clamped to
    ``[-20, 20]`` and the result to ``[-10, 10]`` (unbiased, non-negative, low variance).
    A trailing ``+`` (``k1+``, ``k3+``, ...; verl's straight-through form) keeps the value of
    the named estimator but takes the gradient of ``k2``: k1's and k3's *values* are unbiased
    for the KL, their *gradients* are not, k2's is.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown kl kind {kind!r}; valid kinds are {', '.join(KL_KINDS)}")
    straight_through = kind.endswith("+")
    base = _KL_BASE[kind.rstrip("+")]
    diff = logprobs - ref_logprobs
    if base == "k1":
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base == "k2":
        value = 0.5 * diff.square()
    else:
        ref_minus_logp = _clamped_log_ratio(ref_logprobs, logprobs)
        value = torch.clamp(torch.exp(ref_minus_logp) - ref_minus_logp - 1.0, min=-_K3_LIMIT, max=_K3_LIMIT)
    if not straight_through or base == "k2":
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)`` on max-shifted logits ``z``: it never
    takes the log of a (possibly underflowed) probability, and shifting first avoids the
    cancellation of two large, nearly equal terms when logits are big (e.g. ~1e3 in fp32).
    Logits are expected to be finite.
    """
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``.

    Computed as ``logits[label] - logsumexp(logits)``: only the gathered logit and the
    ``[B, T]`` normaliser are kept, instead of a full ``[B, T, V]`` log-softmax copy (which
    for a 150k vocabulary is the single largest activation of the step).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must match logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    picked = torch.gather(logits, dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic regression loss ``0.5 * (values - returns)^2``, optionally clipped.

    With ``clip_range = c`` the prediction may move at most ``c`` away from
    ``old_values``: ``v_clip = old + clamp(values - old, -c, c)`` and the per-token loss is
    ``0.5 * max((values - returns)^2, (v_clip - returns)^2)`` (pessimistic, as in PPO).

    Returns:
        ``(loss, stats)``; ``stats["vf_clipfrac"]`` is the detached fraction of valid tokens
        where the clipped error is strictly larger (0 without clipping).
    """
    unclipped_sq = (values - returns).square()
    if clip_range is None:
        per_token = 0.5 * unclipped_sq
        clip_active = torch.zeros_like(unclipped_sq)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped_sq = (values_clipped - returns).square()
        per_token = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
        clip_active = (clipped_sq > unclipped_sq).to(unclipped_sq.dtype)
    loss = aggregate_loss(per_token, mask, agg_mode, norm_length)
    stats = {"vf_clipfrac": masked_mean(clip_active.detach(), mask).detach()}
    return loss, stats
