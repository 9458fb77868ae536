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
    "policy_loss",
    "kl_penalty",
    "entropy_from_logits",
    "logprobs_from_logits",
    "value_loss",
]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
_LOG_RATIO_LIMIT = 20.0
_K3_LIMIT = 10.0


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str, norm_length: float | None = None) -> Tensor:
    """Reduce a ``[B, R]`` per-token loss to a scalar over the valid tokens.

    Modes:
        ``token-mean``: sum over all valid tokens / number of valid tokens.
        ``seq-mean-token-mean``: mean over the valid tokens of each sequence, then mean
        over sequences.
        ``seq-mean-token-sum``: sum over the valid tokens of each sequence, then mean over
        sequences.
        ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv:2503.20783): sum over the valid tokens of
        each sequence divided by the constant ``norm_length`` (the response length cap,
        ``algorithm.sampling.max_new_tokens``), then mean over *all* sequences. The divisor
        is the same for every sequence and every step, so no response is up- or
        down-weighted by its length, and because every row counts, a micro-batch's share
        of the mean is exactly its share of the rows (``roles.actor.micro_weight``).

    For ``seq-mean-token-mean`` and ``seq-mean-token-sum``, sequences without any valid
    token are left out of the outer mean, so an empty row does not dilute the loss. An
    all-masked input gives 0.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {mode!r}; valid modes are {', '.join(AGG_MODES)}")
    if loss_mat.dim() != 2 or mask.shape != loss_mat.shape:
        raise ValueError("loss_mat and mask must both be [B, R]")
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (the max response length)")
        return masked_sum(loss_mat, mask, dim=-1).mean() / norm_length
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    seq_has_tokens = (mask != 0).any(dim=-1)
    return masked_mean(per_seq, seq_has_tokens)


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss (``norm_length``: see `aggregate_loss`).

    Per token: ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with
    ``r = exp(logprobs - old_logprobs)``, aggregated with ``agg_mode``.

    Returns:
        ``(loss, stats)``; ``stats`` holds detached scalars ``clipfrac`` (fraction of valid
        tokens where the clipped term is strictly larger, i.e. active and gradient-free) and
        ``approx_kl`` (mean of ``old_logprobs - logprobs`` over valid tokens).
    """
    log_ratio = _clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, mask, agg_mode, norm_length)
    with torch.no_grad():
        clip_active = (clipped > unclipped).to(per_token.dtype)
        stats = {
            "clipfrac": masked_mean(clip_active, mask).detach(),
            "approx_kl": masked_mean(-log_ratio, mask).detach(),
        }
    return loss, stats


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token log-probabilities.

    ``k1``: ``logp - ref`` (unbiased, high variance, can be negative).
    ``k2``: ``0.5 * (logp - ref)^2`` (biased, low variance; its gradient matches the KL's).
    ``k3``: ``exp(ref - logp) - (ref - logp) - 1`` clamped to ``[-10, 10]`` (unbiased,
    non-negative, low variance).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown kl kind {kind!r}; valid kinds are {', '.join(KL_KINDS)}")
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    ref_minus_logp = _clamped_log_ratio(ref_logprobs, logprobs)
    k3 = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
    return torch.clamp(k3, min=-_K3_LIMIT, max=_K3_LIMIT)


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
