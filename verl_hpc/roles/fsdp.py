"""FSDP2 sharding of a Hugging Face causal LM (or value model) over one role's group.

Why per decoder layer and then the root: each layer's parameters are all-gathered just
before it runs and freed after, so peak memory is one layer's full weights plus the
shards — the property that lets the actor, ref and critic share devices. The mesh is
built from the role's own process group, never the world, because rollout and reward
processes must not take part in the actor's collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF model (`model.layers` for Qwen2/Llama)."""
    for owner in (model, getattr(model, "model", None), getattr(model, "backbone", None)):
        inner = getattr(owner, "layers", None) or getattr(getattr(owner, "model", None), "layers", None)
        if isinstance(inner, nn.ModuleList):
            return list(inner)
    return []


class ActivationCheckpointingError(ValueError):
    """`model.gradient_checkpointing` asked of a model that has no per-layer checkpointing."""


def checkpoint_activations(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    Why HF's own switch, non-reentrant, before sharding: every decoder layer of a
    transformers model is already a checkpointable unit, so the layer boundaries match
    FSDP2's units (one gather per layer, recomputed inside the same unit in backward), and
    the non-reentrant form is the one FSDP2 and `torch.compile` support. It acts only in
    training mode, so the rollout's `generate` (eval) and the no-grad passes keep their
    KV cache and speed. Backbones inside a value model are switched the same way. It may
    also be set on a model already sharded (the memory plan's re-plan does): it only marks
    the layers.

    transformers renamed the switch `activation_checkpointing_enable` (5.20+) and warns on
    every call of the old name; the new one is used where it exists, the old one before.
    """
    target = model.backbone if hasattr(model, "backbone") else model
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ActivationCheckpointingError(
            f"model.gradient_checkpointing: {type(target).__name__} has no per-layer activation checkpointing; "
            "set model.gradient_checkpointing: false")
    enable = getattr(target, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def activation_checkpointing_on(model: nn.Module) -> bool:
    """Whether `checkpoint_activations` switched this model (or its value model's backbone) on."""
    target = model.backbone if hasattr(model, "backbone") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5.20+, before
        if hasattr(type(target), name):  # asked of the class: the old property warns when read
            return bool(getattr(target, name))
    return False


def shard_model(model: nn.Module, group: dist.ProcessGroup, device_type: str,
                param_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
    """`fully_shard` every decoder layer, then the root, over `group`; returns the model.

    `offload` (an accelerator only: FSDP2's offload needs one): the shards live in pinned
    host memory and are copied in layer by layer for each all-gather (roles/offload.py).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type=device_type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    where = CPUOffloadPolicy(pin_memory=True) if offload and device_type != "cpu" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=where)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=where)
    return model
