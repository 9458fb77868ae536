"""What a rollout engine holds of the actor: names and whole tensors of the plain architecture.

Why a view and not the actor's parameters: a LoRA actor trains adapters beside frozen base
weights, while the engines (HF copies, vLLM) hold the plain model; every sync sends
`W + (alpha / r) * B @ A` under the base weight's own name, never modifying the base, so no
rounding drifts into it over a run. Every sender and the final export read this one view.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from verl_hpc.utils.dtensor import full_tensor

ADAPTER = "default"  # peft's name for the one adapter a run trains


def has_adapters(model: nn.Module) -> bool:
    return any(f".lora_A.{ADAPTER}." in name for name, _ in model.named_parameters())


def merged_name(name: str) -> str:
    """A parameter's name in the plain architecture (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def _adapted(model: nn.Module) -> dict[str, nn.Module]:
    """Base-weight parameter name -> its peft LoRA layer, for every adapted linear."""
    return {f"{path}.base_layer.weight": module for path, module in model.named_modules()
            if hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {})}


def merged_shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """(plain name, shape) of every weight a rollout engine holds, in `merged_params` order."""
    return [(merged_name(n), p.shape) for n, p in model.named_parameters() if ".lora_" not in n]


def merged_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, full tensor) per weight of the plain architecture, adapters merged in.

    On FSDP2 every rank of the mesh must iterate (each tensor is gathered); the order is
    `named_parameters()` with the adapters left out, the order an engine's model has.
    """
    adapted = _adapted(model)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        tensor = full_tensor(param.detach())
        layer = adapted.get(name)
        if layer is not None:
            a = full_tensor(layer.lora_A[ADAPTER].weight.detach())
            b = full_tensor(layer.lora_B[ADAPTER].weight.detach())
            tensor = torch.addmm(tensor, b.to(tensor.dtype), a.to(tensor.dtype), alpha=layer.scaling[ADAPTER])
        yield merged_name(name), tensor
