"""Which step object a run's lifecycle drives, and which roles a trainer process builds for it.

Why one place: the one-process wiring (embedded.py) and a worker rank (worker.py) must make
the same choice — the RL loop (`RLTrainer`) over prompts, or DPO's offline step over
preference pairs (`DPOTrainer`) — with the same data order, or a resumed or re-placed run
would train on other samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.runtime.build import BuildSpec, Roles, build_roles
from verl_hpc.runtime.placement.one_process import Placement
from verl_hpc.runtime.step.dpo import DPOTrainer
from verl_hpc.runtime.step.dpo_build import build_dpo_roles
from verl_hpc.runtime.step.loop import RLTrainer


def build_process_roles(cfg: RunConfig, run_dir: Path, spec: BuildSpec, actor_model: Any = None,
                        reward_model: Any = None) -> Roles:
    """DPO: the actor and its frozen reference over the pairs; else every role `spec.hosted` names."""
    if cfg.algorithm.dpo is not None:
        return build_dpo_roles(cfg, run_dir, spec, actor_model)
    return build_roles(cfg, run_dir, spec, actor_model, reward_model)


def build_step(cfg: RunConfig, placement: Placement, on_stage: Any = None) -> RLTrainer | DPOTrainer:
    """DPO draws `trainer.batch_size` pairs per step; the RL loop draws batch_size / n prompts."""
    trainer, dpo = cfg.trainer, cfg.algorithm.dpo is not None
    per_step = trainer.batch_size if dpo else trainer.batch_size // cfg.algorithm.sampling.n
    sampler = PromptSampler(len(placement.roles.dataset), per_step, trainer.seed, cfg.data.shuffle)
    return (DPOTrainer if dpo else RLTrainer)(cfg, placement, sampler, on_stage=on_stage)
