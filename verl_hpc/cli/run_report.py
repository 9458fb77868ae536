"""Train a validated config on this machine and print what a user needs afterwards.

Why shared: `verl-hpc train CONFIG` and `verl-hpc verl KEY=VALUE ...` end the same way —
the run directory, the final score, how to resume after a stop or a failed checkpoint
write — and must print it the same way.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

EXIT_NOT_FINISHED = 3  # `train --time-limit` stopped before the end: the same command continues


def summary(steps: int, metrics: dict[str, float]) -> str:
    """`steps: N   final <score>: x` and one line per validation metric (the score only when logged)."""
    score_key = "critic/score/mean" if "critic/score/mean" in metrics else "dpo/reward_accuracy"
    lines = [f"steps: {steps}" + (f"   final {score_key}: {metrics[score_key]:.4f}" if score_key in metrics else "")]
    lines += [f"validation:    {key} {value:.4f}" for key, value in sorted(metrics.items())
              if key.startswith("val-core/")]
    return "\n".join(lines)


def restart_under_allocator(cfg: Any, may_restart: bool) -> None:
    """Restart this command under the host allocator its run's processes get, when that needs a
    preload this process does not have (before torch is loaded here). Silent: a bad config must
    still print one line, and each process logs the allocator it really runs with. `may_restart`
    is False when main() was called from Python (a test, a notebook): not ours to replace."""
    from verl_hpc.config.placement import plan_for_config
    from verl_hpc.utils.host_allocator import needs_reexec, reexec, usable_choice

    if not may_restart:
        return
    chosen = usable_choice(cfg.resources.host_allocator, {g.resources.device_type for g in plan_for_config(cfg).groups})
    if chosen is not None and needs_reexec(chosen, os.environ):
        reexec(chosen)


def train_and_report(cfg: Any, run_dir: str, again: str, executor: Any = None) -> int:
    """Run `cfg` (a RunConfig) in `run_dir` with `executor` (default `LocalExecutor()`);
    `again` is the command that continues it, as the user started the CLI."""
    from verl_hpc.checkpoint.layout import CheckpointError
    from verl_hpc.launch.executor import LocalExecutor
    from verl_hpc.launch.local import WorkerFailure

    executor = executor if executor is not None else LocalExecutor()
    try:
        result = executor.submit(cfg, run_dir).result()
    except (WorkerFailure, CheckpointError) as failure:  # a checkpoint write failed: disk full, I/O error
        # A leading newline: torch's writer threads may still be printing their own traceback,
        # and our one line must start a line of its own.
        sys.stderr.flush()
        print(f"\nverl-hpc: error: {failure}", file=sys.stderr, flush=True)
        print(f"verl-hpc: {run_dir} is kept; once fixed, continue with: {again}", file=sys.stderr, flush=True)
        return 1
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
    print(summary(result.steps, result.last_metrics))
    print(f"tensorboard:   tensorboard --logdir {result.run_dir / 'tensorboard'}")
    if result.hf_model_dir is not None:
        print(f"trained model: {result.hf_model_dir}")
    return 0
