"""Sweep the actor's learning rate: one Slurm job per value, submitted from Python.

    tools/slurm-local start && eval "$(tools/slurm-local env)"      # or any Slurm login node
    python examples/sweep_lr.py --lrs 1e-3 3e-4 --out runs/sweep-lr trainer.total_steps=50

Each value gets its own run directory (`<out>/lr<value>`); the jobs run side by side, and the
script waits for all of them, then prints each final `critic/score/mean`. Exit status 0 when
every job COMPLETED. Extra arguments are config overrides applied to every job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verl_hpc import submit

REPO = Path(__file__).resolve().parents[1]


def final_score(run_dir: Path) -> float | None:
    """The last `critic/score/mean` trainer rank 0 wrote to metrics.jsonl."""
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    scores = [row["critic/score/mean"] for row in rows if "critic/score/mean" in row]
    return scores[-1] if scores else None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "slurm_local.yaml"))
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-4])
    parser.add_argument("--out", default="runs/sweep-lr", help="one run directory per value below this")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for all jobs")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    jobs = {}
    for lr in args.lrs:
        job = submit(args.config, [*overrides, f"trainer.actor_optim.lr={lr}"],
                     run_dir=Path(args.out) / f"lr{lr:g}")
        print(f"lr={lr:g}: submitted job {job.job_id}, run dir {job.run_dir}", flush=True)
        jobs[lr] = job
    all_completed = True
    for lr, job in jobs.items():
        job.wait(timeout=args.timeout)  # the job's exit code; its components' states below
        states = sorted({component["state"] for component in job.status().values()})
        score = final_score(job.run_dir)
        all_completed &= states == ["COMPLETED"]
        shown = f"{score:.4f}" if score is not None else "n/a"
        print(f"lr={lr:g}: job {job.job_id} {'/'.join(states)}, final critic/score/mean {shown}", flush=True)
    return 0 if all_completed else 1


if __name__ == "__main__":
    sys.exit(main())
