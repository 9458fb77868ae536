"""The run's attempts: when each started and ended, where it resumed, and what the gap cost.

Why a file of its own: metrics.jsonl holds steps, and a resumed run rewrites the steps
after its checkpoint, so the record that a job was requeued at 03:12, sat 40 s in the
queue and redid 7 steps would be gone. `attempts.jsonl` is append-only, one line per
event, written by trainer rank 0: Prometheus counts requeues and lost time from it, and
`verl-hpc report` marks restarts on the time axis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HISTORY_FILE = "attempts.jsonl"
WALL_CLOCK = "perf/wall_clock"  # unix seconds at the end of a step, in every metrics row


@dataclass
class Attempt:
    number: int
    started: float
    resumed_at: int               # the step it resumed after (0: from the start)
    job_id: str
    restart_count: int            # Slurm's SLURM_RESTART_COUNT (requeues of this job)
    lost_s: float                 # the gap before it plus the steps it redid
    ended: float | None = None    # None: killed without a word (kill -9, node failure)
    last_step: int | None = None
    reason: str | None = None     # finished, a signal's name, resize, failed


@dataclass(frozen=True)
class RunSummary:
    attempts: int
    requeues: int                 # attempts after the first
    lost_s: float                 # summed over attempts

    @staticmethod
    def of(attempts: Sequence[Attempt]) -> RunSummary:
        return RunSummary(len(attempts), max(0, len(attempts) - 1), sum(a.lost_s for a in attempts))


def lost_seconds(rows_before: Sequence[dict], resume_step: int, now: float) -> float:
    """What a restart cost: the steps after the checkpoint that will run again, plus the time
    between the previous attempt's last step and now (queue, start-up, loading)."""
    redone = sum(float(r.get("timing_s/step", 0.0)) for r in rows_before if r["step"] > resume_step)
    clocks = [float(r[WALL_CLOCK]) for r in rows_before if WALL_CLOCK in r]
    gap = now - max(clocks) if clocks else 0.0
    return redone + max(0.0, gap)


def record_start(run_dir: Path, resumed_at: int, job_id: str, restart_count: int, lost_s: float) -> Attempt:
    attempt = Attempt(len(read_history(run_dir)) + 1, time.time(), resumed_at, job_id, restart_count, lost_s)
    _append(run_dir, {"event": "start", "attempt": attempt.number, "time": attempt.started,
                      "resumed_at": resumed_at, "job_id": job_id, "restart_count": restart_count,
                      "lost_s": round(lost_s, 3)})
    return attempt


def record_end(run_dir: Path, attempt: Attempt, last_step: int, reason: str) -> None:
    _append(run_dir, {"event": "end", "attempt": attempt.number, "time": time.time(), "last_step": last_step,
                      "reason": reason})


def read_history(run_dir: Path) -> list[Attempt]:
    """Every attempt of the run; a torn last line (a kill mid-write) is skipped."""
    path = Path(run_dir) / HISTORY_FILE
    attempts: dict[int, Attempt] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "start":
            attempts[event["attempt"]] = Attempt(event["attempt"], event["time"], event["resumed_at"],
                                                 str(event["job_id"]), event["restart_count"], event["lost_s"])
        elif event.get("event") == "end" and event.get("attempt") in attempts:
            found = attempts[event["attempt"]]
            found.ended, found.last_step, found.reason = event["time"], event["last_step"], event["reason"]
    return [attempts[k] for k in sorted(attempts)]


def _append(run_dir: Path, event: dict) -> None:
    with open(Path(run_dir) / HISTORY_FILE, "a") as f:
        f.write(json.dumps(event) + "\n")
