"""One process's time limit: its deadline clock, the leader's watchdog, one requeue per attempt.

Why apart from the lifecycle: the watchdog must run from the first moments of a worker
(start-up on a busy node can take most of a short attempt, and an attempt that cannot
reach its first step boundary must still be requeued before the limit kills it), long
before the lifecycle exists; and the requeue must happen once whichever of the two asks
first — the watchdog abandoning a step, or the lifecycle at a boundary.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from verl_hpc.config import RunConfig
from verl_hpc.metrics.history import StopRecord, record_stop
from verl_hpc.metrics.tensorboard import read_jsonl_metrics
from verl_hpc.runtime.process.deadline import DeadlineClock, DeadlineWatchdog
from verl_hpc.runtime.process.endtime import EndTime, job_end_time
from verl_hpc.runtime.process.env import JobEnvironment
from verl_hpc.runtime.process.signals import end_job_step, requeue
from verl_hpc.utils.logging import get_logger

if TYPE_CHECKING:  # DCP takes seconds to import: a worker's start-up must not wait for it here
    from verl_hpc.checkpoint.manager import CheckpointManager

log = get_logger("deadline")
STEP_ESTIMATE, SAVE_ESTIMATE, TIME_LEFT = "perf/step_estimate_s", "perf/save_estimate_s", "perf/time_left_s"


class TimeLimit:
    """The clock every process keeps; on the trainer leader also the watchdog and the requeue."""

    def __init__(self, cfg: RunConfig, run_dir: Path, env: JobEnvironment, clock: DeadlineClock, leader: bool):
        self.cfg, self.run_dir, self.env, self.clock, self.leader = cfg, Path(run_dir), env, clock, leader
        self._lock = threading.Lock()
        self._requeued: tuple[bool, str] | None = None
        self.saves: CheckpointManager | None = None  # the leader's: an abandoned step lets its save in flight commit
        self.watchdog = DeadlineWatchdog(clock, self._overdue) if leader else None

    @classmethod
    def start(cls, cfg: RunConfig, run_dir: Path, env: JobEnvironment, leader: bool,
              end_time: float | None = None) -> TimeLimit:
        """Read the end time (leader: `end_time` given by a launcher, else the job's) and start watching."""
        if end_time is not None:
            end = EndTime(end_time, "--time-limit")
        else:
            end = job_end_time() if leader else EndTime()
        slurm = cfg.slurm
        limit = cls(cfg, run_dir, env, DeadlineClock(end, slurm.requeue_margin_seconds, slurm.signal_grace_seconds),
                    leader)
        if leader and end.known:
            log.info("this attempt ends at %s (%s, %.0f s from now); it stops at the step boundary where the "
                     "next step, a checkpoint and %d s no longer fit", time.strftime("%F %T", time.localtime(end.at)),
                     end.source, end.left(), slurm.requeue_margin_seconds)
        if limit.watchdog is not None:
            limit.watchdog.start()
        return limit

    def adopt(self, end: EndTime) -> None:
        """The leader's end time, on a rank that did not read it (it classifies its signals by it)."""
        if not self.leader:
            self.clock.end = end

    def seed(self, resumed_at: int, restore_seconds: float | None) -> None:
        """Estimates to start from: the step before the resume point's, and the restore as a save."""
        if restore_seconds:
            self.clock.saves.add(restore_seconds)
        path = self.run_dir / "tensorboard" / "metrics.jsonl"
        if not self.leader or not resumed_at or not path.exists():
            return
        rows = [r for r in read_jsonl_metrics(path) if r.get("step", 0) <= resumed_at]
        last = rows[-1] if rows else {}
        if last.get(STEP_ESTIMATE):
            self.clock.steps.samples.append(float(last[STEP_ESTIMATE]))
        if last.get(SAVE_ESTIMATE):
            self.clock.saves.samples.append(float(last[SAVE_ESTIMATE]))

    def requeue_once(self, signum: int | None) -> tuple[bool, str]:
        """`scontrol requeue` the first time any thread asks; the same answer every later time."""
        with self._lock:
            if self._requeued is None:
                self._requeued = requeue(self.env, self.cfg.slurm.max_requeues, signum)
            return self._requeued

    def _overdue(self, phase: str, left_s: float) -> None:
        """The watchdog's action (its thread): say so, write it down, requeue — or end the step."""
        budget = self.clock.budget()
        stop = StopRecord("deadline", None, left_s, budget.step_s, budget.save_s, self.clock.margin_s,
                          abandoned=True, phase=phase)
        log.warning("abandoning the %s in progress: %.0f s left, a checkpoint takes ~%.1f s and the margin is "
                    "%.0f s; the newest committed checkpoint is the resume point", phase, left_s, budget.save_s,
                    self.clock.margin_s)
        try:
            record_stop(self.run_dir, self.env.job_id or "local", self.env.restart_count, stop)
        except OSError as err:
            log.warning("could not record the stop in attempts.jsonl: %s", err)
        # The requeue's SIGTERM (SIGKILL after KillWait) would cut off a save still writing: let it
        # commit first while that still leaves the margin.
        if self.saves is not None and not self.saves.settled(max(0.0, self.clock.end.left() - self.clock.margin_s)):
            log.warning("the checkpoint still writing did not commit in time; it is left uncommitted")
        requeued, message = self.requeue_once(None)
        log.warning("%s", message)
        print(f"verl-hpc: {phase} abandoned {left_s:.0f} s before the time limit; {message}", file=sys.stderr,
              flush=True)
        if not requeued and self.env.scheduler == "slurm":
            end_job_step()  # the job ends FAILED now, with the message above, instead of TIMEOUT at the limit

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
