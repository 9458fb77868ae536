"""Statistics and agreements over the trainer ranks of a torch.distributed world.

Why its own object: the loop (advantage whitening, step metrics, dynamic sampling), the
lifecycle (where to resume, the end barrier) and validation all need the same few
collectives, and none of them should know which process group carries them: the trainer
group for statistics, the control group (every process) for what the leader shares.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.utils.collective import all_reduce_kept


class GroupCollectives:
    def __init__(self, ctx: DistContext, world: int, is_leader: bool):
        self.ctx, self.world, self.is_leader = ctx, world, is_leader
        self.leader = ctx.plan.group_ranks(ctx.plan.groups[0].name)[0]  # trainer rank 0's global rank

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        out = tensor.detach().clone()
        all_reduce_kept(out, group=self.ctx.process_group)
        return out

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        out = tensor.detach().clone()
        all_reduce_kept(out, dist.ReduceOp.MAX, self.ctx.process_group)
        return out

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each rank's metrics are its pre-scaled share (roles/actor.py): a plain mean is the global value."""
        if self.world == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        all_reduce_kept(values, group=self.ctx.process_group)
        return {k: float(v) / self.world for k, v in zip(keys, values, strict=True)}

    def gather_to_all(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, value, group=self.ctx.process_group)
        return parts

    def gather_to_leader(self, value: Any) -> list[Any] | None:
        if self.world == 1:
            return [value]
        parts: list[Any] = [None] * self.world if self.is_leader else []
        dist.gather_object(value, parts if self.is_leader else None, dst=self.leader, group=self.ctx.process_group)
        return parts if self.is_leader else None

    def share_from_leader(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.ctx.control_group)
        return box[0]

    def barrier(self, name: str) -> None:
        self.ctx.barrier(name)
