"""An FSDP2 sender's parameters gathered one bucket at a time, into buffers it keeps.

Why: gathering a sharded actor one parameter at a time cost more than sending it. On gloo
(bench/weight_sync.py, sender `fsdp`: two trainer ranks and one receiver, small model)
each parameter paid its own collectives (~0.15 ms of fixed cost apiece, 74 parameters)
and a fresh output buffer (page faults on ~78 MB every sync), and the sender then packed
the gathered tensors into its bucket. Here each trainer rank copies its rows of a whole
bucket's parameters into its chunk of one kept buffer, every rank broadcasts its chunk
(W broadcasts per bucket), and the rows are laid out back to back, parameter by
parameter, in a second kept buffer: the bucket the sender sends as it is (`flat_view`),
with nothing left to pack.

Lifetime: bucket k's tensors live in slot k % 2 and are overwritten when bucket k + 2 is
gathered; the caller must be done with them by then (`post_weights` waits for bucket k's
transfer first). Every trainer rank must gather the same buckets in the same order.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch import nn

from verl_hpc.transport.weights.views import has_adapters

_GATHERERS: weakref.WeakKeyDictionary[nn.Module, BucketGather] = weakref.WeakKeyDictionary()


def _row_sharded_on_host(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(tensor, DTensor) and tensor.device.type == "cpu" and tensor.device_mesh.ndim == 1
            and tuple(tensor.placements) == (Shard(0),) and tensor.ndim >= 1)


def rows_of(shape: torch.Size, world: int, rank: int) -> tuple[int, int]:
    """(first element, elements) of `rank`'s rows of a tensor of `shape` row-sharded over `world`:
    FSDP2's (and torch.chunk's) ceil(rows / world) per rank, the last ranks holding fewer or none."""
    per_rank = -(-shape[0] // world)
    row = math.prod(shape[1:])
    count = max(0, min(per_rank, shape[0] - rank * per_rank))
    return rank * per_rank * row, count * row


def bucket_gatherer(model: nn.Module) -> BucketGather | None:
    """The model's gatherer when every parameter is an FSDP2 row shard in host memory, of one
    dtype and one mesh, and there is no adapter to merge; else None (gather per parameter).

    The answer depends only on the model's layout, so every trainer rank gets the same one.
    Its parameters are the sharded DTensors as first seen, and stay so: FSDP2 keeps those
    objects (the optimizer updates them), while `named_parameters()` yields plain unsharded
    tensors whenever a forward has left the model unsharded (a root kept gathered, say).
    """
    if model in _GATHERERS:
        return _GATHERERS[model]
    params = [p.detach() for _, p in model.named_parameters()]
    fits = (bool(params) and not has_adapters(model) and all(_row_sharded_on_host(p) for p in params)
            and len({p.dtype for p in params}) == 1 and len({id(p.device_mesh) for p in params}) == 1)
    gatherer = BucketGather(params) if fits else None
    if gatherer is not None:
        _GATHERERS[model] = gatherer
    return gatherer


class BucketGather:
    """Whole parameters from their row shards, a bucket (a list of parameter indices) at a time."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.group = params[0].device_mesh.get_group()
        self.world, self.me = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.members = dist.get_process_group_ranks(self.group)
        self._slots: list[torch.Tensor | None] = [None, None]
        self._stage: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []  # outgrown buffers, kept until the next gather is done

    def _buffer(self, current: torch.Tensor | None, numel: int) -> torch.Tensor:
        if current is not None and current.numel() >= numel:
            return current
        if current is not None:
            self._retired.append(current)  # gloo's threads may still release it (pytorch/pytorch#75529)
        return torch.empty(max(numel, 1), dtype=self.params[0].dtype)

    def gather(self, indices: list[int], slot: int) -> list[torch.Tensor]:
        """The full tensors of parameters `indices`, back to back in slot `slot`'s buffer."""
        tensors = [self.params[i] for i in indices]
        per_rank = [-(-t.shape[0] // self.world) for t in tensors]  # FSDP2's (and torch.chunk's) rows per rank
        widths = [rows * math.prod(t.shape[1:]) for rows, t in zip(per_rank, tensors, strict=True)]
        chunk = sum(widths)  # one rank's part of the bucket, each parameter padded to its per_rank rows
        alone = len(tensors) == 1  # one parameter: rank after rank is already row after row
        self._slots[slot] = self._buffer(self._slots[slot], chunk * self.world if alone else
                                         sum(t.numel() for t in tensors))
        if not alone:
            self._stage = self._buffer(self._stage, chunk * self.world)
        stage = self._slots[slot] if alone else self._stage
        mine, offset = stage[self.me * chunk:(self.me + 1) * chunk], 0  # type: ignore[index]
        for tensor, width in zip(tensors, widths, strict=True):
            local = tensor.to_local().reshape(-1)
            mine[offset:offset + local.numel()].copy_(local)
            offset += width
        for r in range(self.world):  # one at a time, never concurrently (module docstring)
            dist.broadcast(stage[r * chunk:(r + 1) * chunk], src=self.members[r], group=self.group)  # type: ignore[index]
        self._retired.clear()
        if alone:
            return [self._slots[slot][:tensors[0].numel()].view(tensors[0].shape)]  # type: ignore[index]
        return self._by_parameter(tensors, per_rank, widths, stage[:chunk * self.world].view(self.world, chunk),
                                  self._slots[slot])  # type: ignore[union-attr]

    def _by_parameter(self, tensors: list[torch.Tensor], per_rank: list[int], widths: list[int],
                      stage: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
        """Rank-major chunks -> each parameter's rows in order, back to back in `out`."""
        views, at, offset = [], 0, 0
        for tensor, rows, width in zip(tensors, per_rank, widths, strict=True):
            numel = tensor.numel()
            block = stage[:, at:at + width]  # [world, this parameter's padded rows per rank]
            if rows * self.world == tensor.shape[0]:  # no padding: one strided copy
                out[offset:offset + numel].view(self.world, width).copy_(block)
            else:
                for r in range(self.world):
                    first, count = rows_of(tensor.shape, self.world, r)
                    out[offset + first:offset + first + count].copy_(block[r, :count])
            views.append(out[offset:offset + numel].view(tensor.shape))
            at, offset = at + width, offset + numel
        return views
