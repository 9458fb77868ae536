"""The seeds' placement comparison on a GPU: crowded vs the project's hybrid engine (vs isolated with 3+ GPUs).

Same job and measurement as `bench/placement.py` (throughput from the trainer's
`timing_s/step`, rotating order, ratios paired per repetition against crowded), with the
roles on CUDA and peak device memory read through NVML — the whole GPU's used memory,
CUDA contexts of every process included, which is what runs out first on a crowded GPU.
- crowded: the embedded loop, actor + rollout + reference in one process on GPU 0;
- project: the hybrid engine (`quickstart_colocated.yaml`), the FSDP2 actor and its
  rollout engine time-sharing GPU 0 in one NCCL rank, the reward in a CPU process (with
  one GPU the project's own default is the embedded loop, i.e. crowded);
- isolated: actor, rollout and reward each on its own GPU — only with 3 or more GPUs.
Without CUDA it returns a result that says it was skipped (so `bench all` runs anywhere).
The models: `small` (~19M) and `medium` (~135M), fp32, batch 128 x 16 new tokens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.placement import BATCH, NEW_TOKENS, measure
from bench.placement import table as cpu_table

ON_GPU0 = ["resources.actor.device_type=cuda", "resources.actor.device_ids=[0]",
           "resources.rollout.device_type=cuda", "resources.rollout.device_ids=[0]"]
# One GPU is one NCCL rank, and a one-process run is the embedded loop (= crowded); the
# hybrid engine's distributed runtime runs when the reward is a process of its own.
GPU_PLACEMENTS: dict[str, tuple[str, list[str]]] = {
    "crowded": ("quickstart.yaml", ON_GPU0),
    "project": ("quickstart_colocated.yaml", [*ON_GPU0, "resources.reward.device_type=cpu",
                                              "resources.reward.device_ids=[1]", "resources.reward.strategy=none"]),
}
ISOLATED = ("quickstart_split.yaml", ["resources.actor.device_type=cuda", "resources.actor.device_ids=[0]",
                                      "resources.rollout.device_type=cuda", "resources.rollout.device_ids=[1]",
                                      "resources.reward.device_type=cuda", "resources.reward.device_ids=[2]"])


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    gpus = _gpu_count()
    base = {"cpus": os.cpu_count(), "gpus": gpus, "batch": BATCH, "new_tokens": NEW_TOKENS, "cases": [],
            "ratios": {}}
    if gpus == 0:
        return {**base, "skipped": "no CUDA GPU on this machine"}
    placements = dict(GPU_PLACEMENTS)
    if gpus >= 3:
        placements["isolated"] = ISOLATED
    plan = [("small", 1, 4)] if quick else [("small", 2, 10), ("medium", 2, 10)]
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_placement_gpu_", dir=scratch))
    try:
        cases = [measure(preset, reps, steps, work, placements) for preset, reps, steps in plan]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**base, "gpu_name": _gpu_name(), "cases": cases,
            "ratios": {k: v for c in cases for k, v in c["ratios"].items()}}


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def table(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"placement_gpu benchmark skipped: {result['skipped']}"
    lines = [f"on {result['gpus']} x {result['gpu_name']}"
             + ("" if result["gpus"] >= 3 else " (isolated needs 3 GPUs: not run)")]
    for case in result["cases"]:
        for row in case["rows"]:
            if "peak_gpu_gb" in row:
                g = row["peak_gpu_gb"]
                lines.append(f"  {case['preset']:<7}{row['placement']:<10} peak GPU memory {g['median']:.2f} GB "
                             f"({g['min']:.2f}-{g['max']:.2f})")
    return cpu_table(result) + "\n" + "\n".join(lines)
