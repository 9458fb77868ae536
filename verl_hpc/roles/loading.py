"""One copy of the weights per sharded group, not one per rank (`model.load: rank0`).

Why: a node running 8 trainer ranks that each `from_pretrained` the model holds 8 full
copies in host memory at once before FSDP2 keeps only a shard of each: for a 70B model,
over a terabyte, for a moment that decides whether the job starts. Here only the group's
first rank reads the files; the others build the model's skeleton with parameters on the
meta device (no memory), FSDP2 shards the skeleton, and every full tensor is broadcast
from the first rank one at a time, each rank keeping only its own slice. Peak memory on a
non-first rank is its shard plus one tensor.

Buffers stay real on every rank (`parameters_on_meta` leaves them alone): a rotary
embedding's frequency table is computed at construction, is not in the checkpoint, and
must not become garbage when the skeleton is given storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters created inside land on the meta device; buffers are created as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def causal_lm_skeleton(path: str, dtype: torch.dtype) -> nn.Module:
    """The model of `path`'s config with parameters on meta: its architecture, not its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def backbone_skeleton(path: str, dtype: torch.dtype) -> nn.Module:
    """`AutoModel` (no head) of `path`'s config on meta: a value model's backbone."""
    from transformers import AutoConfig, AutoModel

    with parameters_on_meta():
        return AutoModel.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def is_skeleton(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


class GroupLoad:
    """How the models of one sharded group get their weights: read by every rank, or by the first.

    `skeleton` says whether this rank should build skeletons (`causal_lm_skeleton`);
    `shard(model, shard_fn)` shards a model and, with `rank0`, fills every rank's slice
    from the first rank's full copy.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, mode: str) -> None:
        self.group, self.device = group, device
        self.rank0 = mode == "rank0" and group is not None and dist.get_world_size(group) > 1
        self.leader = group is None or dist.get_rank(group) == 0

    @property
    def skeleton(self) -> bool:
        return self.rank0 and not self.leader

    def shard(self, model: nn.Module, shard_fn: Any, offloaded: bool = False) -> nn.Module:
        """`shard_fn(model)` (FSDP2), then, with rank0, the first rank's weights into every shard.

        `offloaded`: `shard_fn` keeps the shards in host memory, so a skeleton's are made there.
        """
        full = dict(model.state_dict()) if self.rank0 and self.leader else None
        shard_fn(model)
        if self.rank0:
            storage = torch.device("cpu") if offloaded else self.device
            fill_from_leader(model, full, self.group, self.device, storage)  # type: ignore[arg-type]
        return model


@torch.no_grad()
def fill_from_leader(model: nn.Module, full: dict[str, torch.Tensor] | None, group: dist.ProcessGroup,
                     device: torch.device, storage: torch.device | None = None) -> None:
    """Every parameter's full tensor broadcast from the group's first rank; each keeps its slice.

    `full` is the first rank's state dict from before sharding (None elsewhere). Every
    rank walks the sharded model's state dict in the same order, so the broadcasts pair up.
    The broadcasts run on `device`; a skeleton's tensors are made on `storage` (default: `device`).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if full is None and is_skeleton(model):
        buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
        model.to_empty(device=storage or device)
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    src = dist.get_global_rank(group, 0)
    for name, target in model.state_dict().items():
        local = target.to_local() if isinstance(target, DTensor) else target
        # Popped: the first rank's full copy shrinks as the shards fill (FSDP2 kept only slices).
        whole = full.pop(name).to(device, local.dtype) if full is not None else \
            torch.empty(target.shape, dtype=local.dtype, device=device)
        dist.broadcast(whole, src=src, group=group)
        if isinstance(target, DTensor):  # this rank's slice of the whole, as FSDP2 lays it out
            whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local.copy_(whole)
