"""Train a validated config on this machine and print what a user needs afterwards.

Why shared: `verl-hpc train CONFIG` and `verl-hpc verl KEY=VALUE ...` end the same way —
the run directory, the final score, how to resume after a stop or a failed checkpoint
write — and must print it the same way.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

EXIT_NOT_FINISHED = 3  # `train --time-limit` stopped before the end: the same command continues


def train_and_report(cfg: Any, run_dir: str, again: str, time_limit_s: float | None = None) -> int:
    """Run `cfg` (a RunConfig) in `run_dir`; `again` is the command that continues it."""
    from verl_hpc.checkpoint.layout import CheckpointError
    from verl_hpc.launch.local import WorkerFailure
    from verl_hpc.launch.train import train

    try:
        result = train(cfg, run_dir=run_dir, time_limit_s=time_limit_s)
    except (WorkerFailure, CheckpointError) as failure:  # a checkpoint write failed: disk full, I/O error
        # A leading newline: torch's writer threads may still be printing their own traceback,
        # and our one line must start a line of its own.
        sys.stderr.flush()
        print(f"\nverl-hpc: error: {failure}", file=sys.stderr, flush=True)
        print(f"verl-hpc: {run_dir} is kept; once fixed, continue with: {again}", file=sys.stderr, flush=True)
        return 1
    score_key = "critic/score/mean" if "critic/score/mean" in result.last_metrics else "dpo/reward_accuracy"
    score = result.last_metrics.get(score_key)
    print(f"run directory: {result.run_dir}")
    if result.stopped_by in ("deadline", "time limit"):
        how = ("stopped at its deadline" if result.stopped_by == "deadline" else
               "reached its time limit mid-step; the last committed checkpoint is kept")
        print(f"{how} after step {result.steps} of {cfg.trainer.total_steps}. To continue: {again}")
        return EXIT_NOT_FINISHED
    if result.stopped_by is not None:
        print(f"stopped by {result.stopped_by} after step {result.steps}; the checkpoint is saved. "
              f"To resume: {again}")
        return 128 + getattr(signal.Signals, result.stopped_by, signal.SIGTERM).value
    print(f"steps: {result.steps}   final {score_key}: {score:.4f}" if score is not None else "")
    for key, value in sorted(result.last_metrics.items()):
        if key.startswith("val-core/"):
            print(f"validation:    {key} {value:.4f}")
    print(f"tensorboard:   tensorboard --logdir {result.run_dir / 'tensorboard'}")
    if result.hf_model_dir is not None:
        print(f"trained model: {result.hf_model_dir}")
    return 0
