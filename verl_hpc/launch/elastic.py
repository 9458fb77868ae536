"""Elastic resources from the outside: `update_resource`, `verl-hpc resize`, the Slurm resubmit.

Why these live in `launch`: they act on a run that some executor started (the local
launcher, or a Slurm job), by writing the request the trainer reads at its next step
boundary (runtime/state/resize.py explains the protocol) and, under Slurm, by submitting the
resized job. `RunHandle.update_resource` is the same request on a handle. docs/elastic.md
says what a resize costs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from verl_hpc.launch.handle import RunHandle
from verl_hpc.runtime.state import resize


def resolve_target(target: str | Path) -> Path:
    """A run directory, or a Slurm job id whose run directory the job registry (or scontrol) knows."""
    if re.fullmatch(r"\s*\d+(\+\d+)?\s*", str(target)) and not Path(str(target)).is_dir():
        from verl_hpc.config import ConfigError

        handle = RunHandle.attach(str(target))
        if handle.run_dir is None:
            raise ConfigError("run_dir", f"the run directory of job {handle.job_id} is unknown",
                              "pass the run directory instead of the job id")
        return handle.run_dir
    return Path(target)


def update_resource(run: str | Path, component: str, device_ids: list[int] | None = None,
                    strategy: str | None = None, **fields: Any) -> Path:
    """Ask a running run to move `component` (a role) to new resources at its next step boundary.

    `run` is the run directory (or a Slurm job id). Returns the request file. The run
    checkpoints, stops, and restarts with the new resources; the step counter continues.
    Example: `update_resource("runs/split", "reward", device_ids=[3, 4], strategy="data_parallel")`.
    """
    overrides = resize.overrides_for(component, device_ids=device_ids, strategy=strategy, **fields)
    return resize.request_resize(resolve_target(run), overrides)


def resubmit(run_dir: Path, python: str | None = None) -> RunHandle:
    """Under Slurm, after the job stopped for a resize: apply it and submit the new job shape.

    Why a new job and not `scontrol requeue`: a requeued job keeps the components, task
    counts and GRES it was submitted with; Slurm cannot change a hetjob's shape. The new
    job uses the same run directory, so it resumes from the checkpoint the old one saved.
    """
    from verl_hpc.launch.executor import SlurmExecutor

    cfg = resize.apply_accepted(run_dir)
    # Run from inside the old job: its SLURM_* variables (restart count, het group sizes) must
    # not leak into the new job's environment. SLURM_CONF says which cluster; it stays.
    for name in [n for n in os.environ if n.startswith("SLURM_") and n != "SLURM_CONF"]:
        del os.environ[name]
    return SlurmExecutor(python).submit(cfg, run_dir=run_dir)


def device_report(run_dir: Path, gpu_usage: dict[str, Any] | None = None) -> list[str]:
    """Per-role device use for `verl-hpc status`: the plan's devices, the last logged memory gauges.

    What it can know from the run directory alone: which devices each process group was
    given (config.yaml, as resized), trainer rank 0's memory at its last logged step, and
    any resize still waiting for a step boundary. With `gpu_usage` (`get_gpu_usage()` on the
    machine the run uses: a local run) each CUDA role's GPUs are shown with their memory.
    """
    from verl_hpc.config import load_config
    from verl_hpc.config.placement import plan_for_config

    if not (run_dir / "config.yaml").is_file():
        return []
    cfg = load_config(run_dir / "config.yaml")
    plan = plan_for_config(cfg)
    lines = ["devices per role:"]
    for group in plan.groups:
        res = group.resources
        lines.append(f"  {group.name} ({', '.join(group.roles)}): {group.size} task(s), {res.device_type} "
                     f"device_ids {res.device_ids}, strategy {res.strategy}")
        if res.device_type == "cuda" and gpu_usage is not None:
            lines.extend(_gpu_lines(res.device_ids, gpu_usage))
    if cfg.resources.env is not None:
        env = cfg.resources.env
        lines.append(f"  env (environment workers): {env.num_workers} process(es), {env.cpus_per_worker} CPU(s) "
                     f"each, {env.nodes} node(s) of their own under Slurm")
    last = _last_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    gauges = {k: v for k, v in last.items() if k.startswith(("memory/", "resource/"))}
    if gauges:
        shown = ", ".join(f"{k}={v:.3g}" for k, v in sorted(gauges.items()))
        lines.append(f"  trainer rank 0 at step {int(last['step'])}: {shown}")
    if resize.pending(run_dir):
        lines.append(f"resize pending (applied at the next step boundary): {run_dir / resize.REQUEST_FILE}")
    for entry in resize.history(run_dir):
        lines.append(f"resized after step {entry['after_step']}: {', '.join(entry['overrides'])}")
    return lines


def _gpu_lines(device_ids: list[int], usage: dict[str, Any]) -> list[str]:
    """NVML's view of a role's GPUs; ids map through CUDA_VISIBLE_DEVICES as the launcher maps them."""
    from verl_hpc.utils.devices import visible_cuda_ids

    if not usage.get("available"):
        return [f"    GPU use unknown: {usage.get('reason')}"]
    visible = visible_cuda_ids()
    by_index = {d["index"]: d for d in usage["devices"]}
    lines = []
    for device_id in device_ids:
        physical = visible[device_id] if visible and device_id < len(visible) else device_id
        gpu = by_index.get(physical)
        if gpu is None:
            lines.append(f"    device {device_id}: no such GPU here (NVML sees {len(by_index)})")
            continue
        busy = f", {gpu['utilization_percent']}% busy" if gpu["utilization_percent"] is not None else ""
        lines.append(f"    device {device_id} = GPU {physical} ({gpu['name']}): {gpu['memory_used_bytes'] / 2**30:.1f} of "
                     f"{gpu['memory_total_bytes'] / 2**30:.1f} GiB used{busy}")
    return lines


def _last_metrics(path: Path) -> dict[str, float]:
    import json

    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}
