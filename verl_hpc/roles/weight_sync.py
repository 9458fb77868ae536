"""Moving the actor's new weights into the rollout engine after every update.

Colocated (hybrid engine): the trainer ranks themselves host the engine; parameters are
gathered one at a time from the FSDP2 shards and copied straight into the engine's
tensors, so no rank ever holds a second full copy of the model — at most one extra
parameter. Split: trainer rank 0 packs the gathered parameters into flat buckets and
broadcasts each over the sync group to the rollout ranks, which unpack them into their
own copy. Both sides walk `named_parameters()` of the same architecture in the same
order, so only a small header (version, count, bytes) crosses the wire besides data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_hpc.roles.fsdp import full_tensor

# 16 MB: small enough that packing/unpacking one bucket hides behind the next one's
# transfer (64 MB buckets left a 78 MB model in two and ran 3.6x a plain broadcast;
# 16 MB: 1.4-1.8x on gloo here, bench/weight_sync.py), large enough for NCCL's bandwidth.
DEFAULT_BUCKET_BYTES = 16 * 2**20
STOP_VERSION = -2  # a header with this version tells the receivers to stop: no weights follow


class WeightSyncError(RuntimeError):
    """The two sides of a sync disagree (architecture, version): never load half a model."""


def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter; on FSDP2 every rank of the mesh must iterate."""
    for name, param in model.named_parameters():
        yield name, full_tensor(param.detach())


def stream_into(source: nn.Module, target: nn.Module) -> int:
    """Colocated sync: copy each gathered parameter of `source` into `target`; returns bytes."""
    target_params = dict(target.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, tensor in iter_full_params(source):
            dest = target_params[name]
            dest.copy_(tensor.to(dest.device, dest.dtype))
            copied += dest.numel() * dest.element_size()
    return copied


def gather_only(model: nn.Module) -> None:
    """Trainer ranks outside the sync group: join each parameter's gather, send nothing."""
    for _ in iter_full_params(model):
        pass


def _buckets(names_sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive parameters grouped so each bucket stays under the limit."""
    buckets: list[list[int]] = [[]]
    used = 0
    for i, (_, nbytes) in enumerate(names_sizes):
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += nbytes
    return buckets


def broadcast_weights(model: nn.Module, group: dist.ProcessGroup, src: int, version: int,
                      is_sender: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[int, int]:
    """Bucketed broadcast from `src` (global rank) to every rank of `group`; returns (version, bytes).

    The sender passes its (possibly FSDP-sharded) actor; receivers pass a model of the
    same architecture and get its parameters overwritten in place. The other trainer
    ranks call `gather_only` at the same time, since the FSDP2 gathers are collectives.
    """
    params = list(model.named_parameters())
    device = params[0][1].device  # NCCL moves only GPU tensors; gloo takes either
    if not is_sender:
        got, tensors = receive_weights([(n, p.shape) for n, p in params], group, src, bucket_bytes, device)
        moved = _copy_into(params, tensors)
        return got, moved
    header = torch.tensor([version, len(params), sum(p.numel() for _, p in params)], dtype=torch.int64,
                          device=device)
    if group is not None:
        dist.broadcast(header, src=src, group=group)
    if version == STOP_VERSION:
        return STOP_VERSION, 0
    sizes = [(n, p.numel() * 4) for n, p in params]
    sent = 0
    gathered = iter_full_params(model)
    in_flight: Any = None  # packing bucket k+1 overlaps with bucket k on the wire
    for bucket in _buckets(sizes, bucket_bytes):
        flat = _pack([next(gathered)[1] for _ in bucket])
        if in_flight is not None:
            in_flight.wait()
        in_flight = dist.broadcast(flat, src=src, group=group, async_op=True) if group is not None else None
        sent += flat.numel() * flat.element_size()
    if in_flight is not None:
        in_flight.wait()
    return version, sent


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat float32 bucket; a lone contiguous float32 tensor is sent as it is (no copy)."""
    if len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous():
        return tensors[0].detach().reshape(-1)
    return torch.cat([t.float().reshape(-1) for t in tensors])


def receive_weights(specs: list[tuple[str, torch.Size]], group: dist.ProcessGroup, src: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | str = "cpu",
                    ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """Receiver side of `broadcast_weights`: the version, then (name, tensor) as buckets land.

    The iterator must be consumed to the end (each bucket is a collective); an engine's
    `load_weights` does exactly that. A STOP header yields no tensors.
    """
    header = torch.empty(3, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    version = int(header[0])
    if version == STOP_VERSION:
        return STOP_VERSION, iter(())
    elements = sum(shape.numel() for _, shape in specs)
    if int(header[1]) != len(specs) or int(header[2]) != elements:
        raise WeightSyncError(f"actor and rollout models differ: sender has {int(header[1])} tensors / "
                              f"{int(header[2])} elements, receiver {len(specs)} / {elements}")

    buckets = _buckets([(n, shape.numel() * 4) for n, shape in specs], bucket_bytes)

    def post(bucket: list[int]) -> tuple[torch.Tensor, Any]:
        flat = torch.empty(sum(specs[i][1].numel() for i in bucket), dtype=torch.float32, device=device)
        return flat, dist.broadcast(flat, src=src, group=group, async_op=True)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        # Bucket k+1 is already being received while the consumer copies bucket k's tensors.
        upcoming = post(buckets[0]) if buckets and buckets[0] else None
        for k, bucket in enumerate(buckets):
            if upcoming is None:
                return
            flat, work = upcoming
            work.wait()
            upcoming = post(buckets[k + 1]) if k + 1 < len(buckets) else None
            offset = 0
            for i in bucket:
                name, shape = specs[i]
                yield name, flat[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()

    return version, tensors()


def push_weights(named_tensors: Iterator[tuple[str, torch.Tensor]], engine, version: int) -> int:
    """Feed (name, tensor) pairs into a rollout engine's `load_weights`; returns the bytes moved."""
    moved = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal moved
        for name, tensor in named_tensors:
            moved += tensor.numel() * tensor.element_size()
            yield name, tensor

    engine.load_weights(counted(), version)
    return moved


@torch.no_grad()
def _copy_into(params: list[tuple[str, nn.Parameter]], tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    moved = 0
    for (_, param), (_, tensor) in zip(params, tensors, strict=True):
        param.copy_(tensor.to(param.device, param.dtype))
        moved += tensor.numel() * tensor.element_size()
    return moved
