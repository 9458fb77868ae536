"""What a run checkpoints, when, and how it resumes — shared by both trainers.

Why the trainers only call `maybe_save` / `restore`: the state layout
(`{"actor": {"model", "optim"}, "critic": ...}` as tensors through DCP, counters and
data order as JSON) must be identical for the embedded and the distributed runtime, so
a run can be resumed by either, on another number of processes.

Randomness is re-seeded at every step from (seed, step, role rank) (`step_seed`), so a
resumed run samples exactly what the uninterrupted run sampled without having to
restore every process's generator; the generators are still saved for inspection.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.checkpoint.manager import CheckpointManager, latest_checkpoint
from verl_hpc.config import ConfigError, RunConfig
from verl_hpc.config.checks import expand_path
from verl_hpc.runtime import run_state
from verl_hpc.utils.logging import get_logger

log = get_logger("checkpoint")
RUN_STATE_FILE = "run_state.json"


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, step, stream)."""
    return (seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1)


def seed_all(value: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) from one value."""
    import random

    import numpy as np

    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def reseed(seed: int, step: int, stream: int = 0) -> None:
    seed_all(step_seed(seed, step, stream))


def build_manager(cfg: RunConfig, run_dir: Path, process_group=None, async_group=None) -> CheckpointManager:
    ck = cfg.checkpoint
    return CheckpointManager(run_dir / "checkpoints", keep_last=ck.keep_last, keep_every=ck.keep_every,
                             async_save=ck.async_save, process_group=process_group, async_group=async_group)


def resume_path(cfg: RunConfig, run_dir: Path) -> Path | None:
    """`checkpoint.resume`: auto (newest committed, if any), never, or a path."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    # sha256, not only sizes: a bit flip keeps every size, and loading it would silently train
    # on corrupted weights; a corrupted newest checkpoint is skipped (warned) for the one before.
    if mode == "auto":
        return latest_checkpoint(run_dir / "checkpoints", verify="sha256")
    path = expand_path(mode)
    if (path / "checkpoints").is_dir():
        path = latest_checkpoint(path / "checkpoints", verify="sha256") or path
    if not (path / "manifest.json").is_file():
        raise ConfigError("checkpoint.resume", f"{path} is not a committed checkpoint",
                          "point it at a step_* directory from `verl-hpc ckpt list`, or use auto")
    return path


def role_state(actor, critic) -> dict[str, Any]:
    """The tensors to checkpoint (sharded DTensors under FSDP2: each rank writes its part)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
    state: dict[str, Any] = {"actor": {"model": model_sd, "optim": optim_sd}}
    if critic is not None:
        model_sd, optim_sd = get_state_dict(critic.model, critic.optimizer)
        state["critic"] = {"model": model_sd, "optim": optim_sd}
    return state


def apply_role_state(state: dict[str, Any], actor, critic) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(actor.model, actor.optimizer, model_state_dict=state["actor"]["model"],
                   optim_state_dict=state["actor"]["optim"])
    if critic is not None:
        set_state_dict(critic.model, critic.optimizer, model_state_dict=state["critic"]["model"],
                       optim_state_dict=state["critic"]["optim"])


class RunCheckpointer:
    """Cadence (steps, minutes, end, on request) + the run state around the manager."""

    def __init__(self, cfg: RunConfig, run_dir: Path, manager: CheckpointManager, world_sizes: dict[str, int],
                 is_leader: bool, group=None):
        self.cfg, self.run_dir, self.manager = cfg, run_dir, manager
        self.world_sizes, self.is_leader, self.group = world_sizes, is_leader, group
        self.last_save = time.monotonic()
        self.requested = False

    def due(self, step: int) -> bool:
        """Whether to save after `step`; every rank of the group gets the leader's answer."""
        ck = self.cfg.checkpoint
        due = self.requested or step == self.cfg.trainer.total_steps
        due = due or bool(ck.interval_steps and step % ck.interval_steps == 0)
        due = due or bool(ck.interval_minutes and time.monotonic() - self.last_save >= 60 * ck.interval_minutes)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            flag = torch.tensor([int(due)])
            dist.broadcast(flag, src=dist.get_global_rank(self.group, 0), group=self.group)
            due = bool(flag.item())
        return due

    def save(self, step: int, policy_version: int, sampler, actor, critic, block: bool | None = None,
             extra_state: dict[str, Any] | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
        state = {**(extra_state or {}), "step": step, "policy_version": policy_version,
                 "sampler": sampler.state_dict(),
                 "actor_scheduler": actor.scheduler.state_dict(),
                 "critic_scheduler": critic.scheduler.state_dict() if critic is not None else None,
                 "actor_allocator": actor.allocator.state_dict()}
        meta = {"world_sizes": self.world_sizes, "model_dir": str(expand_path(self.cfg.model.path)),
                "config_hash": run_state.config_hash((self.run_dir / "config.yaml").read_text()),
                "policy_version": policy_version}
        start = time.perf_counter()
        path = self.manager.save(step, role_state(actor, critic), meta,
                                 rank_files={"rng.json": run_state.dumps(run_state.rng_state())},
                                 shared_files={RUN_STATE_FILE: run_state.dumps(state), **(extra_files or {})},
                                 block=block)
        self.last_save, self.requested = time.monotonic(), False
        self.save_seconds = time.perf_counter() - start
        log.info("checkpoint of step %d %s (%.3fs stall)", step, "written" if block else "started",
                 self.save_seconds)
        return path

    def restore(self, path: Path, sampler, actor, critic) -> dict[str, Any]:
        """Load tensors (resharded to this world) and the run state; returns the run state."""
        start = time.perf_counter()
        state = role_state(actor, critic)
        manifest = self.manager.load(path, state)
        apply_role_state(state, actor, critic)
        run = run_state.loads(self.manager.read_shared(path, RUN_STATE_FILE))
        sampler.load_state_dict(run["sampler"])
        actor.scheduler.load_state_dict(run["actor_scheduler"])
        if critic is not None and run.get("critic_scheduler"):
            critic.scheduler.load_state_dict(run["critic_scheduler"])
        recorded = manifest.get("meta", {}).get("world_sizes")
        if run.get("actor_allocator") and recorded == self.world_sizes:  # new resources: learn afresh
            actor.allocator.load_state_dict(run["actor_allocator"])
        # The duration and a sub-second wall clock ride along: the preemption benchmark splits a
        # restart into start-up and restore with them (the log's own time field has 1 s steps).
        seconds = time.perf_counter() - start
        log.info("resumed from %s at step %d in %.3fs (saved with %s, now %s)", path, run["step"], seconds,
                 recorded, self.world_sizes, extra={"fields": {"restore_s": round(seconds, 4),
                                                               "unix_time": round(time.time(), 3)}})
        return run
