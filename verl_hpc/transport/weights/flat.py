"""Parameters that live side by side in one flat buffer, so a weight sync moves no extra bytes.

Why: on the wire a sync is a few flat float32 buckets. If the receiving model's
parameters are views into one buffer laid out in `named_parameters()` order, each bucket
can be received straight into its slice — no temporary bucket, no unpacking copy — and a
sender whose parameters already sit that way can send a slice without packing. On this
2-core box a fresh 78 MB bucket costs more (page faults) than the broadcast itself.
"""

from __future__ import annotations

import torch
from torch import nn

WIRE_DTYPE = torch.float32  # what buckets carry; a flat buffer of another dtype cannot be received into


def flat_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view spanning `tensors` if they lie back to back, in order, in one storage; else None.

    Only float32 (the wire dtype) qualifies, so a view can be sent or received as it is.
    """
    if not tensors or any(type(t) is not torch.Tensor for t in tensors):  # a DTensor shard has no such storage
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for tensor in tensors:
        if (tensor.dtype != WIRE_DTYPE or tensor.device != first.device or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    return torch.as_strided(first.detach(), (offset - first.storage_offset(),), (1,), first.storage_offset())


def params_view(model: nn.Module) -> torch.Tensor | None:
    """All of `model`'s parameters as one flat view, if they already lie back to back; else None."""
    return flat_view([p.detach() for _, p in model.named_parameters()])


def flatten_params(model: nn.Module) -> torch.Tensor | None:
    """The model's parameters as views into one float32 buffer (made once, in place); None if they can't be.

    Returns the existing buffer when the parameters already form one. Re-homing swaps
    each parameter's `.data`, so the `nn.Parameter` objects (and tied weights, which
    `named_parameters()` lists once) stay the same; only a model whose parameters are
    all float32 dense tensors on one device qualifies. Call it only on a model whose
    tensors nobody else holds apart from its `nn.Parameter`s (an old `.data` would go
    stale): the rollout engine's own copy, or a split run's lone actor
    (`weight_sender.flatten_sender`), whose optimizer, checkpoint and HF export all go
    through the parameters.
    """
    params = [p for _, p in model.named_parameters()]
    if not params:
        return None
    existing = params_view(model)
    if existing is not None:
        return existing
    device = params[0].device
    if any(type(p.data) is not torch.Tensor or p.dtype != WIRE_DTYPE or p.device != device or p.is_sparse
           for p in params):
        return None
    flat = torch.empty(sum(p.numel() for p in params), dtype=WIRE_DTYPE, device=device)
    offset = 0
    with torch.no_grad():
        for param in params:
            view = flat[offset:offset + param.numel()].view(param.shape)
            view.copy_(param.detach())
            param.data = view
            offset += param.numel()
    return flat


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `b` is `a`'s very memory (a bucket received in place): copying would be a no-op."""
    return (a.data_ptr() == b.data_ptr() and a.device == b.device and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())
