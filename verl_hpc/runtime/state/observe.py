"""Which process writes metrics where, and the run's attempt history.

Why here and not in the lifecycle: the lifecycle decides *when* to log; who speaks
(trainer rank 0 for the step, each serving group's first rank for its own part), under
which directory and port, and what an attempt's start and end leave in attempts.jsonl are
one concern, the same for every placement.
"""

from __future__ import annotations

import time
from pathlib import Path

from verl_hpc.config import RunConfig
from verl_hpc.metrics import Emitter, MetricSinks, open_sinks, read_jsonl_metrics
from verl_hpc.metrics.history import (
    Attempt,
    RunSummary,
    StopRecord,
    lost_seconds,
    read_history,
    record_end,
    record_start,
)
from verl_hpc.runtime.process.env import JobEnvironment


class RunObserver:
    """This process's sinks (None when it does not speak) and, on trainer rank 0, the attempt."""

    def __init__(self, cfg: RunConfig, run_dir: Path, speaker: tuple[str, int, int] | None):
        """`speaker`: (role, global rank, group index) when this process writes metrics, else None."""
        self.cfg, self.run_dir = cfg, run_dir
        self.speaker = speaker
        self.sinks: MetricSinks | None = None
        self.attempt: Attempt | None = None

    def log_dir(self) -> Path:
        """The trainer's files in tensorboard/, a serving group's in tensorboard/<role>_rank<N>/."""
        role, rank, _ = self.speaker  # type: ignore[misc]
        base = self.run_dir / "tensorboard"
        return base if role == "trainer" else base / f"{role}_rank{rank}"

    def open(self, resumed_at: int, end_time: float | None = None) -> MetricSinks | None:
        """Record the attempt (trainer) and its end time, if known, then open the sinks; steps after
        `resumed_at` are rewritten."""
        if self.speaker is None:
            return None
        role, rank, group_index = self.speaker
        env = JobEnvironment.from_env()
        summary = None
        if role == "trainer":
            self.attempt = self._start_attempt(resumed_at, env, end_time)
            summary = RunSummary.of(read_history(self.run_dir))
        emitter = Emitter(self.run_dir, self.cfg.trainer.run_name or self.run_dir.name, role, rank,
                          env.job_id or "local")
        logging_cfg = self.cfg.logging
        prometheus = logging_cfg.prometheus
        if prometheus.port:  # a fixed base port: each speaking group's first rank on its own
            logging_cfg = logging_cfg.model_copy(update={"prometheus": prometheus.model_copy(
                update={"port": prometheus.port + group_index})})
        self.sinks = open_sinks(logging_cfg, emitter, self.log_dir(), purge_step=resumed_at + 1, summary=summary)
        return self.sinks

    def _start_attempt(self, resumed_at: int, env: JobEnvironment, end_time: float | None) -> Attempt:
        metrics = self.run_dir / "tensorboard" / "metrics.jsonl"
        rows = read_jsonl_metrics(metrics) if metrics.exists() and resumed_at else []
        lost = lost_seconds(rows, resumed_at, time.time()) if read_history(self.run_dir) else 0.0
        return record_start(self.run_dir, resumed_at, env.job_id or "local", env.restart_count, lost, end_time)

    def close(self, last_step: int, reason: str, stop: StopRecord | None = None) -> None:
        """`stop`: which path ended the attempt early and how much time was left (None: it did not stop early)."""
        if self.sinks is not None:
            self.sinks.close()
        if self.attempt is not None:
            record_end(self.run_dir, self.attempt, last_step, reason, stop)
