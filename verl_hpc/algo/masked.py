"""Reductions over the valid (unmasked) entries of a padded tensor.

RL batches for LLMs are ragged: prompts and responses have different lengths and are
right-padded (or, in multi-turn rollouts, have holes where tool output was injected).
Every statistic the trainer computes must therefore ignore padded positions, otherwise the
amount of padding -- an artefact of batching -- would change the gradient.

Design choices:

* Masked entries are replaced by zero with ``torch.where`` *before* multiplying by the mask,
  so whatever sits in padded slots (stale values, huge logits) can never leak into a result.
* Denominators are guarded so an all-masked input yields 0 instead of NaN, and nothing here
  calls ``.item()``: no host/device synchronisation happens inside these helpers.
* ``mask`` may be bool or float; float masks act as per-element weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def _as_weights(x: Tensor, mask: Tensor) -> Tensor:
    """Return ``mask`` as a weight tensor in the dtype of ``x``."""
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match x shape {tuple(x.shape)}")
    return mask.to(dtype=x.dtype)


def _safe_denominator(count: Tensor) -> Tensor:
    """Replace zero counts by one so an empty selection divides to 0, not NaN."""
    return torch.where(count != 0, count, torch.ones_like(count))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when ``dim`` is None)."""
    weights = _as_weights(x, mask)
    clean = torch.where(weights != 0, x, torch.zeros_like(x)) * weights
    if dim is None:
        return clean.sum()
    return clean.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Weighted mean of ``x`` over ``dim``; 0 where the mask selects nothing."""
    weights = _as_weights(x, mask)
    total = masked_sum(x, weights, dim=dim)
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    return total / _safe_denominator(count)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries of ``x`` (a scalar over all dimensions).

    With ``unbiased`` the Bessel correction ``n / (n - 1)`` is applied, matching
    ``torch.var``. When fewer than two entries are valid the correction is undefined; rather
    than raising (which would need a device sync) the biased value is returned, which is 0
    for a single element and 0 for an empty selection.
    """
    weights = _as_weights(x, mask)
    mean = masked_mean(x, weights)
    centered_sq = (x - mean) ** 2
    var = masked_mean(centered_sq, weights)
    if unbiased:
        count = weights.sum()
        correction = count / torch.where(count > 1, count - 1, torch.ones_like(count))
        var = torch.where(count > 1, var * correction, var)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise the valid entries of ``x`` to unit variance (and zero mean if ``shift_mean``).

    Statistics are computed over all valid entries of the whole tensor (batch-level
    whitening, as used for PPO advantages). With ``shift_mean=False`` the original mean is
    kept and only the scale changes. Masked positions of the output are 0.
    """
    weights = _as_weights(x, mask)
    mean = masked_mean(x, weights)
    var = masked_var(x, weights, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(weights != 0, whitened, torch.zeros_like(whitened))
