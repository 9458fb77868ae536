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
    KV cache and speed. Backbones inside a value model are switched the same way.
    """
    target = model.backbone if hasattr(model, "backbone") else model
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ActivationCheckpointingError(
            f"model.gradient_checkpointing: {type(target).__name__} has no per-layer activation checkpointing; "
            "set model.gradient_checkpointing: false")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


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


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor shard (a collective over its mesh), or itself.

    FSDP2's host-memory shards (gloo) are gathered by `_gather_rows`, not DTensor's
    `full_tensor`: every native crash of a trainer rank seen so far (SIGSEGV, SIGABRT,
    "malloc(): unaligned tcache chunk detected", in CI and once here) struck inside or just
    after that path's asynchronous functional all-gather, whose padded input is a temporary
    dropped while gloo's threads may still hold it (pytorch#75529). `_gather_rows` is one
    synchronous all-gather whose buffers outlive it.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type == "cpu" and tensor.device_mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),):
        return _gather_rows(tensor)
    return tensor.full_tensor()


_last_gather: list[torch.Tensor] = []  # the previous gather's buffers, kept until the next one is done


def _gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A row-sharded DTensor, whole: rank r's rows are rows [r * c, r * c + its count) with
    c = ceil(rows / world) (FSDP2's and DTensor's chunking), so each rank copies its rows
    into its own chunk of one buffer and every rank broadcasts its chunk to the others.

    Why broadcasts and not gloo's all-gather: on gloo the all-gather of 40 MB took 3.3x one
    broadcast of the whole (its internal staging copy and ring), W broadcasts one after the
    other 1.4x (docs/benchmarks.md, "An FSDP2 sender").
    """
    group = tensor.device_mesh.get_group()
    world, rows = dist.get_world_size(group), tensor.shape[0]
    per_rank = -(-rows // world)
    local = tensor.to_local()
    out = local.new_empty((per_rank * world, *tensor.shape[1:]))
    chunks = [out.narrow(0, r * per_rank, per_rank) for r in range(world)]
    me = dist.get_rank(group)
    chunks[me][:local.shape[0]].copy_(local)
    members = dist.get_process_group_ranks(group)
    for r in range(world):  # one at a time: see bucket_gather.py on concurrent gloo collectives
        dist.broadcast(chunks[r], src=members[r], group=group)
    _last_gather[:] = [out]
    return out[:rows]


def to_float(value: torch.Tensor | float) -> float:
    return float(full_tensor(value)) if isinstance(value, torch.Tensor) else float(value)
