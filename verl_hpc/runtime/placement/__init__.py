"""Placements of the one loop: where each stage runs (base: one process; colocated; split).

`build_distributed` assembles a worker process's roles and placement from the process
plan; `Placement` itself is the one-process placement (runtime/embedded.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from verl_hpc.config import RunConfig
from verl_hpc.runtime.build import BuildSpec, build_roles
from verl_hpc.runtime.placement.distributed import DistributedPlacement
from verl_hpc.runtime.placement.one_process import Placement, Timer, generate_rows
from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.runtime.process.heartbeat import Heartbeat

__all__ = ["DistributedPlacement", "Placement", "Timer", "build_distributed", "generate_rows"]


def device_for(ctx: DistContext) -> torch.device:
    from verl_hpc.utils.resource import pin_to_device

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


def build_distributed(cfg: RunConfig, ctx: DistContext, run_dir: Path, heartbeat: Heartbeat) -> DistributedPlacement:
    from verl_hpc.runtime.placement.colocated import Colocated
    from verl_hpc.runtime.placement.split import Split

    if cfg.algorithm.dpo is not None:  # the actor and its reference on every trainer rank, no engine
        from verl_hpc.runtime.step.dpo_build import build_dpo_roles

        return DistributedPlacement(cfg, run_dir, build_dpo_roles(cfg, run_dir, build_spec(cfg, ctx, run_dir)),
                                    ctx, heartbeat)
    roles = build_roles(cfg, run_dir, build_spec(cfg, ctx, run_dir))
    colocated = "rollout" in ctx.plan.groups[0].roles
    return (Colocated if colocated else Split)(cfg, run_dir, roles, ctx, heartbeat)
