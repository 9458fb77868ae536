"""Placements of the one loop: where each stage runs (one process, colocated, split).

`one_process_placement` (one_process.py) is the embedded run's; `build_distributed`
assembles a worker process's roles and its `Placement` from the process plan: its seat,
the collectives over its trainer group, the stages (trainer ranks) or the service
(rollout, ref, critic and reward ranks), and the lifecycle hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import RunConfig
from verl_hpc.runtime.build import BuildSpec
from verl_hpc.runtime.placement.collectives import GroupCollectives
from verl_hpc.runtime.placement.distributed import DistributedLifecycle, distributed_seat, role_clients
from verl_hpc.runtime.placement.one_process import generate_rows, one_process_placement
from verl_hpc.runtime.placement.remote import RoleService
from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.runtime.process.heartbeat import Heartbeat
from verl_hpc.runtime.state.run_dir import read_explicit
from verl_hpc.runtime.step.kinds import build_process_roles, step_kind
from verl_hpc.runtime.step.memory import MemorySeat, attach_watch, plan_process
from verl_hpc.runtime.step.stages import Placement

__all__ = ["build_distributed", "generate_rows", "one_process_placement"]


def device_for(ctx: DistContext) -> torch.device:
    from verl_hpc.utils.devices import pin_to_device

    res = ctx.group.resources
    return pin_to_device(res.device_type, None, 0) if res.device_type == "cuda" else torch.device("cpu")


def build_spec(cfg: RunConfig, ctx: DistContext, run_dir: Path) -> BuildSpec:
    """This process's roles: its group's, with FSDP over the group when it shards."""
    group = ctx.group
    sharded = group.size > 1 and group.resources.strategy == "fsdp" and \
        any(r in group.roles for r in ("actor", "critic", "ref"))
    has_reward_group = any(g.name == "reward" for g in ctx.plan.groups)
    return BuildSpec(hosted=group.roles, device=device_for(ctx), fsdp_group=ctx.process_group if sharded else None,
                     engine_colocated="actor" in group.roles, rollout_builds_reward=not has_reward_group,
                     engine_log=run_dir / "logs" / f"vllm_engine_rank{ctx.env.rank}.log")


PlacementBuilder = Callable[..., Placement]
PLACEMENTS: dict[str, PlacementBuilder] = {}  # how a generating run's trainer group gets its rollouts


def register_placement(name: str) -> Callable[[PlacementBuilder], PlacementBuilder]:
    """A placement builder takes (cfg, run_dir, roles, seat, collectives, ctx, heartbeat, clients, service)."""
    def add(builder: PlacementBuilder) -> PlacementBuilder:
        PLACEMENTS[name] = builder
        return builder
    return add


def build_distributed(cfg: RunConfig, ctx: DistContext, run_dir: Path, heartbeat: Heartbeat) -> Placement:
    """This worker's placement: colocated when the trainer group generates, else split; a step kind
    that generates nothing (DPO) has the actor and its reference on every trainer rank, no engine."""
    spec = build_spec(cfg, ctx, run_dir)
    cfg, watch = plan_process(cfg, memory_seat(spec, ctx), read_explicit(run_dir), agree=lambda n: group_min(ctx, n))
    roles = build_process_roles(cfg, run_dir, spec)
    seat = distributed_seat(cfg, ctx)
    collectives = GroupCollectives(ctx, seat.world, seat.is_leader)
    clients = role_clients(cfg, ctx)
    service: Any = RoleService(cfg, roles, ctx, heartbeat, seat.world) \
        if ctx.group.name in ("ref", "reward", "critic") else None
    if not step_kind(cfg).generates:
        lifecycle = DistributedLifecycle(cfg, run_dir, roles, seat, None, ctx=ctx, heartbeat=heartbeat,
                                         clients=clients)
        return Placement("distributed", roles, seat, collectives, lifecycle, service=service)
    name = "colocated" if "rollout" in ctx.plan.groups[0].roles else "split"
    placement = PLACEMENTS[name](cfg, run_dir, roles, seat, collectives, ctx, heartbeat, clients, service)
    attach_watch(placement, watch)
    return placement


def memory_seat(spec: BuildSpec, ctx: DistContext) -> MemorySeat:
    """Where this rank's memory plan applies: its roles, device and group; on a CPU the node's
    processes share the host's memory, a GPU is its process's own."""
    shared = ctx.env.local_world_size if spec.device.type == "cpu" else 1
    return MemorySeat(spec.hosted, spec.device, group_size=ctx.group.size, sharded=spec.fsdp_group is not None,
                      processes=shared, name=f"{ctx.group.name} rank {ctx.env.rank}")


def group_min(ctx: DistContext, value: int) -> int:
    """The smallest `value` over this rank's group (every rank of a group plans alike)."""
    import torch.distributed as dist

    from verl_hpc.utils.collective import all_reduce_kept

    tensor = torch.tensor([value], dtype=torch.int64)
    if ctx.group.size > 1:
        all_reduce_kept(tensor, dist.ReduceOp.MIN, ctx.process_group)
    return int(tensor.item())


@register_placement("colocated")
def _colocated(cfg: RunConfig, run_dir: Path, roles: Any, seat: Any, collectives: GroupCollectives,
               ctx: DistContext, heartbeat: Heartbeat, clients: dict[str, Any], service: Any) -> Placement:
    from verl_hpc.runtime.placement.colocated import ColocatedStages

    stages = ColocatedStages(cfg, roles, seat, collectives, clients) if seat.trains else None
    lifecycle = DistributedLifecycle(cfg, run_dir, roles, seat, stages, ctx=ctx, heartbeat=heartbeat, clients=clients)
    return Placement("colocated", roles, seat, collectives, lifecycle, stages, service)


@register_placement("split")
def _split(cfg: RunConfig, run_dir: Path, roles: Any, seat: Any, collectives: GroupCollectives, ctx: DistContext,
           heartbeat: Heartbeat, clients: dict[str, Any], service: Any) -> Placement:
    from verl_hpc.runtime.placement.rollout_service import RolloutService
    from verl_hpc.runtime.placement.split import SplitLifecycle, SplitLinks, SplitStages

    links = SplitLinks(cfg, run_dir, roles, ctx, seat.trains, seat.rank, seat.is_leader)
    stages = SplitStages(cfg, roles, seat, collectives, clients, links=links, ctx=ctx) if seat.trains else None
    if ctx.is_role("rollout"):
        service = RolloutService(cfg, roles, ctx, heartbeat, links)
    lifecycle = SplitLifecycle(cfg, run_dir, roles, seat, stages, ctx=ctx, heartbeat=heartbeat, clients=clients,
                               links=links, service=service if ctx.is_role("rollout") else None)
    return Placement("split", roles, seat, collectives, lifecycle, stages, service)
