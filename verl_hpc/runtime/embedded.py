"""The run in this one process: every role here, the smallest placement of the one loop.

Why a module of its own: a one-process run needs no torch.distributed world, no launcher
and no transport, but it must be the very loop and lifecycle every other placement runs;
this is only the wiring (build the roles, the placement, the checkpointer) for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import RunConfig, dump_config
from verl_hpc.config.explicit import explicit_fields
from verl_hpc.runtime.build import BuildSpec, resolve_device
from verl_hpc.runtime.lifecycle import RunLifecycle, TrainResult
from verl_hpc.runtime.placement.one_process import one_process_placement
from verl_hpc.runtime.process.signals import StopFlag
from verl_hpc.runtime.state.checkpointing import RunCheckpointer, build_manager
from verl_hpc.runtime.state.run_dir import write_explicit
from verl_hpc.runtime.state.seeding import seed_all
from verl_hpc.runtime.step.kinds import build_process_roles, build_step
from verl_hpc.runtime.step.memory import MemorySeat, attach_watch, plan_process
from verl_hpc.utils.logging import get_logger, setup_logging

log = get_logger("trainer")


def hosted_roles(cfg: RunConfig) -> tuple[str, ...]:
    algo = cfg.algorithm
    roles = ["actor", "rollout", "reward"]
    roles += ["ref"] if algo.needs_ref else []
    roles += ["critic"] if algo.needs_critic else []
    return tuple(roles)


def train_in_process(cfg: RunConfig, run_dir: Path, actor_model: Any = None, reward_model: Any = None) -> TrainResult:
    """Run `cfg` to the end (or a stop signal) in this process; `run_dir` is already prepared."""
    setup_logging(run_dir / "logs", "trainer", 0, cfg.logging.level)
    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    seed_all(cfg.trainer.seed)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    write_explicit(run_dir, cfg)
    spec = BuildSpec(hosted=hosted_roles(cfg), device=resolve_device(cfg), launched=False,
                     engine_log=run_dir / "logs" / "vllm_engine_rank0.log")
    cfg, watch = plan_process(cfg, MemorySeat(spec.hosted, spec.device, name="one process"),
                              explicit_fields(cfg), actor_model)
    roles = build_process_roles(cfg, run_dir, spec, actor_model, reward_model)
    placement = one_process_placement(cfg, run_dir, roles)
    attach_watch(placement, watch)
    checkpointer = RunCheckpointer(cfg, run_dir, build_manager(cfg, run_dir), {"trainer": 1}, True)
    stop = StopFlag().install()
    trainer = build_step(cfg, placement)
    try:
        outcome = RunLifecycle(cfg, run_dir, trainer, checkpointer, stop).run()
    finally:
        stop.restore()
        placement.lifecycle.close()
    if outcome.stopped_by is not None:
        return TrainResult(run_dir, trainer.step, None, outcome.metrics, outcome.stopped_by)
    hf_dir = run_dir / "hf_model" if cfg.trainer.save_hf_model else None
    name, key = trainer.progress_metric
    log.info("done: %d steps, final %s %.4f", trainer.step, name, outcome.metrics.get(key, float("nan")))
    return TrainResult(run_dir, trainer.step, hf_dir, outcome.metrics)
