"""Log-probs of sampled tokens through the output head, with a backward written by hand.

Why by hand: on a real vocabulary (SmolLM2: 49k) the step's cost outside the matmuls is
the passes over `[tokens, vocab]` chunks. Autograd's way through `gather - logsumexp`,
under a checkpoint that recomputes the chunk, makes about a dozen such passes per chunk:
the recompute's own logsumexp, the gather's zero-filled gradient, logsumexp's backward
(subtract, exp, multiply) and the sum of the two. The gradient of `log softmax(z)[label]`
is known in closed form, `onehot(label) - softmax(z)`, so this backward recomputes the
chunk's logits once and turns them into the gradient in place: subtract the saved
log-normaliser, exp, scale, add at the labels. Forward keeps only the hidden states and
one number per token, as the checkpoint did.

The numbers: log-probs are `gather - logsumexp` of the same logits, bit for bit the
whole path's; gradients agree with autograd's to float rounding
(tests/roles/test_chunked_logprobs.py). An entropy bonus needs the entropy's own gradient and
keeps the checkpointed autograd path (forward.py); as a metric the entropy is computed
here from the same logits, `-sum(p * log p)`, without autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

NEG = -1e9  # the excluded pad token's logit (forward.exclude_padding): finite, never sampled


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pad_id: int | None,
                temperature: float) -> torch.Tensor:
    """The sampled distribution's fp32 logits for one chunk (forward.py's `tempered` of the head's
    output), made in place after the matmul: no copy for the pad column or the temperature."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias).float()  # under autocast: bf16 hidden
    if pad_id is not None:
        logits[:, pad_id] = NEG
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _HeadLogprobs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], bias) -> log p(label) [T]; and, as a metric, the entropies."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, pad_id: int | None, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head_logits(hidden, weight, bias, pad_id, temperature)
        picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
        lse = torch.logsumexp(logits, dim=-1)
        entropy = lse.new_zeros(0)
        if with_entropy:
            log_p = logits.sub_(lse.unsqueeze(-1))  # the logits are not needed again
            entropy = -torch.linalg.vecdot(log_p.exp(), log_p)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.pad_id, ctx.temperature = pad_id, temperature
        ctx.mark_non_differentiable(entropy)
        return picked - lse, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy_grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        grad = grad.float()
        # d log p(label) / d z = onehot(label) - softmax(z), built in the recomputed logits' storage.
        dz = head_logits(hidden, weight, bias, ctx.pad_id, ctx.temperature)
        dz.sub_(lse.unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))
        dz.scatter_add_(-1, labels.long().unsqueeze(-1), grad.unsqueeze(-1))
        if ctx.pad_id is not None:  # a constant logit: no gradient reaches the head through it
            dz[:, ctx.pad_id] = 0.0
        if ctx.temperature != 1.0:
            dz.div_(ctx.temperature)
        dz = dz.to(weight.dtype)
        grad_hidden = (dz @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = dz.t() @ hidden.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = dz.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  temperature: float, pad_id: int | None, with_entropy: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's log-probs of `labels` ([T], differentiable) and entropies ([T], a metric, or None)."""
    logprobs, entropy = _HeadLogprobs.apply(hidden, weight, bias, labels, pad_id, temperature, with_entropy)
    return logprobs, entropy if with_entropy else None
