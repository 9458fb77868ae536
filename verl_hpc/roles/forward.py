"""The one forward pass every trainer-side role shares: logits of the response tokens only.

Why one function: the actor's logprobs, the reference's logprobs and the trainer's
recomputation of old logprobs must agree bit for bit on the same weights; computing
them in one place (same slicing, same temperature) guarantees it. `logits_to_keep`
skips the LM head over prompt tokens, which no loss uses.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from verl_hpc.algo import entropy_from_logits, logprobs_from_logits


def response_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Logits predicting each response token, [B, R, V], divided by the sampling temperature."""
    resp_len = inputs["response_mask"].shape[1]
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                position_ids=inputs["position_ids"], logits_to_keep=resp_len + 1, use_cache=False)
    logits = exclude_padding(out.logits[:, :-1, :], unsampled_token(model))
    return logits / temperature if temperature != 1.0 else logits


def unsampled_token(model: torch.nn.Module) -> int | None:
    """The pad token, when it is distinct from EOS: never an action, never sampled."""
    config = getattr(model, "config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    return pad if pad is not None and pad != eos else None


def exclude_padding(logits: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """Take the pad token out of the policy's distribution, for the sampler and the trainer alike.

    Why both: if only the sampler skipped it, the probability mass the policy keeps on pad
    would silently make the sampled distribution differ from the one being optimised — an
    off-policy error that grows with training and ends in collapse. A large finite
    negative (not -inf) keeps entropies finite.
    """
    if pad_id is None:
        return logits
    return logits.index_fill(-1, torch.tensor([pad_id], device=logits.device), -1e9)


def response_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs of the response under `model` (and entropies if asked)."""
    logits = response_logits(model, inputs, temperature).float()
    resp_len = inputs["response_mask"].shape[1]
    labels = inputs["input_ids"][:, -resp_len:]
    logprobs = logprobs_from_logits(logits, labels)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy


def micro_batches(inputs: dict[str, torch.Tensor], size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Slices of a dict of [B, ...] tensors along the batch dimension."""
    total = next(iter(inputs.values())).shape[0]
    for start in range(0, total, size):
        yield {k: v[start:start + size] for k, v in inputs.items()}


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float,
                     micro_batch_size: int) -> torch.Tensor:
    """Inference-only logprobs over micro-batches (reference policy, old policy)."""
    parts = [response_logprobs(model, mb, temperature)[0] for mb in micro_batches(inputs, micro_batch_size)]
    return torch.cat(parts, dim=0)


def to_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if all(v.device == device for v in inputs.values()):
        return inputs
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
