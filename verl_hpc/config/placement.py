"""From per-role resources to process groups: which processes exist and what each hosts.

Why a pure function of the config: the local launcher (how many processes to spawn),
the Slurm executor (one hetjob component per group) and the runtime (which role am I,
given my global rank) must agree exactly, so all three read this one plan.

Global ranks are contiguous per group, in plan order — the order Slurm gives the
components of `srun --het-group=0-N` — so a rank's group follows from running sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_hpc.config.resources import ResourceConfig, RoleResources


@dataclass(frozen=True)
class GroupSpec:
    """One set of identical processes (a hetjob component): its roles and devices."""

    name: str
    roles: tuple[str, ...]
    resources: RoleResources

    @property
    def size(self) -> int:
        return self.resources.world_size


@dataclass(frozen=True)
class ProcessPlan:
    groups: tuple[GroupSpec, ...]

    @property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    def group_ranks(self, name: str) -> list[int]:
        start = 0
        for group in self.groups:
            if group.name == name:
                return list(range(start, start + group.size))
            start += group.size
        raise KeyError(f"no process group {name!r}; groups are {[g.name for g in self.groups]}")

    def locate(self, rank: int) -> tuple[GroupSpec, int]:
        """The group a global rank belongs to and its rank within that group."""
        start = 0
        for group in self.groups:
            if rank < start + group.size:
                return group, rank - start
            start += group.size
        raise ValueError(f"rank {rank} is outside the world of {self.world_size} processes")

    def group_of_role(self, role: str) -> GroupSpec:
        for group in self.groups:
            if role in group.roles:
                return group
        raise KeyError(f"role {role!r} is not placed in any process group")


def plan_processes(resources: ResourceConfig, needs_critic: bool, needs_ref: bool,
                   reward_is_model: bool, needs_rollout: bool = True) -> ProcessPlan:
    """The trainer group (actor + critic/ref unless placed apart), rollout, reward model.

    Colocated placement puts the rollout engine inside the trainer group (the hybrid
    engine). Critic and ref join the trainer group unless they have resources of their
    own; a reward model gets a group when `resources.reward` is set (else it runs in the
    trainer group); a rule-based reward runs beside the rollouts and needs no group.
    """
    trainer_roles = ["actor"]
    groups: list[GroupSpec] = []
    for role, needed in (("critic", needs_critic), ("ref", needs_ref)):
        spec = resources.role(role)
        if needed and spec is not None and spec.device_ids != resources.actor.device_ids:
            groups.append(GroupSpec(role, (role,), spec))
        elif needed:
            trainer_roles.append(role)
    if not needs_rollout:  # DPO: offline pairs, nothing generated
        pass
    elif resources.placement == "colocated":
        trainer_roles.append("rollout")
    else:
        groups.append(GroupSpec("rollout", ("rollout",), resources.rollout))
    if reward_is_model and resources.reward is not None:
        groups.append(GroupSpec("reward", ("reward",), resources.reward))
    elif reward_is_model:
        trainer_roles.append("reward")
    trainer = GroupSpec("trainer", tuple(trainer_roles), resources.actor)
    return ProcessPlan((trainer, *groups))


def plan_for_config(cfg) -> ProcessPlan:  # cfg: RunConfig (imported lazily: schema imports this module's siblings)
    """The process plan a run config implies (what needs a critic, a ref, a reward group).

    A reward group exists when `resources.reward` is set: it scores with the reward model,
    or runs the rule function there; without it, a rule runs beside the rollouts.
    """
    algo = cfg.algorithm
    return plan_processes(cfg.resources, needs_critic=algo.needs_critic, needs_ref=algo.needs_ref,
                          reward_is_model=cfg.reward is not None and (cfg.reward.is_model
                                                                      or cfg.resources.reward is not None),
                          needs_rollout=algo.step_kind == "rl")
