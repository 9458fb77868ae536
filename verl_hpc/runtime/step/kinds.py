"""Step kinds: what one step of a run is, asked of a registry instead of branched on.

Why a registry: the RL loop over prompts (`RLTrainer`) and DPO's offline step over
preference pairs (`DPOTrainer`) differ in what a process builds (an engine and a reward, or
the pairs and a frozen reference), in how many dataset rows a step draws, and in the step
object the lifecycle drives — and in nothing else. The one-process wiring (embedded.py)
and a worker rank (worker.py) both ask `step_kind(cfg)`, so they make the same choice with
the same data order, and a new kind (agent episodes, say) is one more entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.runtime.build import BuildSpec, Roles, build_roles
from verl_hpc.runtime.step.counters import StepCounters
from verl_hpc.runtime.step.dpo import DPOTrainer
from verl_hpc.runtime.step.dpo_build import build_dpo_roles
from verl_hpc.runtime.step.loop import RLTrainer
from verl_hpc.runtime.step.stages import Placement


@dataclass(frozen=True)
class StepKind:
    name: str
    build_roles: Callable[..., Roles]                 # (cfg, run_dir, spec, actor_model, reward_model) -> Roles
    make_step: Callable[..., StepCounters]            # (cfg, placement, sampler, on_stage=) -> the step object
    draws_per_step: Callable[[RunConfig], int]        # dataset rows the sampler hands out per step
    generates: bool = True                            # has rollout engines (and so weight syncs, serving groups)


STEP_KINDS: dict[str, StepKind] = {}


def register_step_kind(kind: StepKind) -> StepKind:
    STEP_KINDS[kind.name] = kind
    return kind


def step_kind(cfg: RunConfig) -> StepKind:
    return STEP_KINDS[cfg.algorithm.step_kind]


def build_process_roles(cfg: RunConfig, run_dir: Path, spec: BuildSpec, actor_model: Any = None,
                        reward_model: Any = None) -> Roles:
    """What this process holds for the run's step kind (every role `spec.hosted` names)."""
    return step_kind(cfg).build_roles(cfg, run_dir, spec, actor_model, reward_model)


def build_step(cfg: RunConfig, placement: Placement, on_stage: Any = None) -> StepCounters:
    """The step object, with a prompt sampler drawing the kind's rows per step in the run's seeded order."""
    kind = step_kind(cfg)
    sampler = PromptSampler(len(placement.roles.dataset), kind.draws_per_step(cfg), cfg.trainer.seed,
                            cfg.data.shuffle)
    return kind.make_step(cfg, placement, sampler, on_stage=on_stage)


register_step_kind(StepKind(
    "rl", build_roles=build_roles, make_step=RLTrainer,
    draws_per_step=lambda cfg: cfg.trainer.batch_size // cfg.algorithm.sampling.n))
register_step_kind(StepKind(
    "dpo", build_roles=lambda cfg, run_dir, spec, actor_model=None, reward_model=None:
    build_dpo_roles(cfg, run_dir, spec, actor_model),
    make_step=DPOTrainer, draws_per_step=lambda cfg: cfg.trainer.batch_size, generates=False))
