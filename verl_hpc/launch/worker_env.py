"""The environment of one rank the local launcher starts: a pure function of the plan and the rank.

Why apart from the launcher: it is what `verl-hpc train --dry-run` prints and what a fork of the
worker server receives (forkserver.py), so it must not depend on how the process is started.
"""

from __future__ import annotations

import os
from pathlib import Path

from verl_hpc.config.placement import ProcessPlan


def _visible_device(device_id: int, inherited: str | None) -> str:
    """Map a configured device id through the launcher's own CUDA_VISIBLE_DEVICES.

    Why: ids in the config mean "the Nth GPU this run may use" (as torch indices do), so
    a launcher started with CUDA_VISIBLE_DEVICES=4,5 gives id 0 GPU 4, never GPU 0.
    """
    visible = [d.strip() for d in (inherited or "").split(",") if d.strip()]
    if not visible:
        return str(device_id)
    if device_id >= len(visible):
        raise ValueError(f"device id {device_id} is not among the {len(visible)} GPU(s) in "
                         f"CUDA_VISIBLE_DEVICES={inherited}")
    return visible[device_id]


def worker_env(plan: ProcessPlan, rank: int, master_port: int, run_dir: Path,
               base_env: dict[str, str]) -> dict[str, str]:
    """The full environment of one global rank: base_env plus the launcher's variables. Unless base_env
    sets OMP_NUM_THREADS the ranks share the cores (torchrun's rule): ranks that each take every core
    spin against each other (5x the CPU for the same numbers, measured)."""
    group, group_rank = plan.locate(rank)
    env = dict(base_env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # so a crash's last log lines are really the last
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.world_size)))
    env.update({
        "VERL_HPC_RANK": str(rank), "VERL_HPC_WORLD_SIZE": str(plan.world_size),
        "VERL_HPC_LOCAL_RANK": str(rank), "VERL_HPC_GROUP": group.name,
        "VERL_HPC_GROUP_RANK": str(group_rank), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port), "VERL_HPC_RUN_DIR": str(run_dir),
    })
    if group.resources.device_type == "cuda":  # this rank's slot(s): a tensor-parallel engine takes several
        width = group.resources.devices_per_process
        ids = group.resources.device_ids[group_rank * width:(group_rank + 1) * width]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_visible_device(i, base_env.get("CUDA_VISIBLE_DEVICES")) for i in ids)
    return env
