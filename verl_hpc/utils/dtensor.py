"""Whole tensors from FSDP2's DTensor shards.

Why here, below every layer that needs it: the actor's optimizer (grad norms), the weight
sync (full parameters for the engines) and the checkpoint export all turn a shard into the
whole tensor, and they must do it the same, crash-free way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
