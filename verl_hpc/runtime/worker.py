"""One process of the distributed runtime: `python -m verl_hpc.runtime.worker`.

Started by the local launcher or by `srun` in a Slurm (het)job; everything it needs
comes from the environment (rank, world, master) and the run directory (config.yaml).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from verl_hpc.config import load_config
from verl_hpc.config.placement import plan_for_config
from verl_hpc.runtime.dist import init_distributed
from verl_hpc.runtime.dist_trainer import DistributedTrainer
from verl_hpc.runtime.env import JobEnvironment
from verl_hpc.utils.logging import get_logger, setup_logging


def main() -> int:
    run_dir = Path(os.environ["VERL_HPC_RUN_DIR"])
    cfg = load_config(run_dir / "config.yaml")
    if cfg.trainer.torch_threads:
        import torch

        torch.set_num_threads(cfg.trainer.torch_threads)
    env = JobEnvironment.from_env()
    plan = plan_for_config(cfg)
    group, rank_in_group = plan.locate(env.rank)
    setup_logging(run_dir / "logs", group.name, env.rank, cfg.logging.level, console=rank_in_group == 0)
    env.write_debug_file(run_dir / "logs" / f"env_{group.name}_rank{env.rank}.json")
    ctx = init_distributed(env, plan, cfg.resources.resolved_backend(), cfg.resources.timeout_seconds)
    try:
        stopped_by = DistributedTrainer(cfg, ctx, run_dir).train()
        if stopped_by is not None:
            get_logger("worker").info("stopped: %s", stopped_by)
    except Exception as err:  # the launcher shows a log's last lines: make the cause the last one
        traceback.print_exc()
        get_logger("worker").error("failed: %s", err, exc_info=True)
        print(f"[{group.name} rank {env.rank}] FAILED: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
