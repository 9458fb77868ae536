"""The run's attempts: when each started and ended, where it resumed, and what the gap cost.

Why a file of its own: metrics.jsonl holds steps, and a resumed run rewrites the steps
after its checkpoint, so the record that a job was requeued at 03:12, sat 40 s in the
queue and redid 7 steps would be gone. `attempts.jsonl` is append-only, one line per
event, written by trainer rank 0: Prometheus counts requeues and lost time from it, and
`verl-hpc report` marks restarts on the time axis.

Events: `start` (with the attempt's end time when one is known), `end` (why it ended, and for
a stop which path stopped it and how much time was left: `StopRecord`), and `stop`, written
by the deadline watchdog the moment it abandons a step — the process may be killed before
its `end` line (`job_id` and `restart_count` say which attempt it belongs to).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

HISTORY_FILE = "attempts.jsonl"
WALL_CLOCK = "perf/wall_clock"  # unix seconds at the end of a step, in every metrics row


@dataclass(frozen=True)
class StopRecord:
    """Why an attempt stopped early, and what the time budget said at that moment."""

    path: str                          # deadline, signal, preemption
    signal: str | None = None          # the signal's name on the signal and preemption paths
    time_left_s: float | None = None   # until the end time; None: no end time known
    step_estimate_s: float | None = None
    save_estimate_s: float | None = None
    margin_s: float | None = None
    abandoned: bool = False            # a step or save was given up (no checkpoint of it)
    phase: str | None = None           # what was abandoned: start, step, save

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @staticmethod
    def from_json(data: dict[str, Any]) -> StopRecord:
        names = {f.name for f in fields(StopRecord)}
        return StopRecord(**{k: v for k, v in data.items() if k in names})

    def describe(self) -> str:
        """'deadline, 41 s left (next step ~6.2 s + save ~3.1 s + margin 15 s)'."""
        text = self.path + (f" ({self.signal})" if self.signal else "")
        if self.abandoned:
            text += f", {self.phase or 'step'} abandoned"
        if self.time_left_s is not None:
            text += f", {self.time_left_s:.0f} s left"
        if self.step_estimate_s is not None and self.save_estimate_s is not None:
            text += (f" (next step ~{self.step_estimate_s:.1f} s + save ~{self.save_estimate_s:.1f} s"
                     f" + margin {self.margin_s or 0:.0f} s)")
        return text


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
    reason: str | None = None     # finished, a signal's name, deadline, resize, failed
    end_time: float | None = None  # when the scheduler ends it (unix seconds), if known
    stop: StopRecord | None = None  # an early stop: which path, how much time was left


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


def record_start(run_dir: Path, resumed_at: int, job_id: str, restart_count: int, lost_s: float,
                 end_time: float | None = None) -> Attempt:
    attempt = Attempt(len(read_history(run_dir)) + 1, time.time(), resumed_at, job_id, restart_count, lost_s,
                      end_time=end_time)
    _append(run_dir, {"event": "start", "attempt": attempt.number, "time": attempt.started,
                      "resumed_at": resumed_at, "job_id": job_id, "restart_count": restart_count,
                      "lost_s": round(lost_s, 3), "end_time": end_time})
    return attempt


def record_end(run_dir: Path, attempt: Attempt, last_step: int, reason: str, stop: StopRecord | None = None) -> None:
    event: dict[str, Any] = {"event": "end", "attempt": attempt.number, "time": time.time(),
                             "last_step": last_step, "reason": reason}
    if stop is not None:
        event["stop"] = stop.to_json()
    _append(run_dir, event)


def record_stop(run_dir: Path, job_id: str, restart_count: int, stop: StopRecord) -> None:
    """The watchdog's line: written at once, from its thread, before anything can kill the process."""
    _append(run_dir, {"event": "stop", "time": time.time(), "job_id": job_id, "restart_count": restart_count,
                      "stop": stop.to_json()})


def read_history(run_dir: Path) -> list[Attempt]:
    """Every attempt of the run; a torn last line (a kill mid-write) is skipped."""
    path = Path(run_dir) / HISTORY_FILE
    attempts: dict[int, Attempt] = {}
    stops: list[dict] = []
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "start":
            attempts[event["attempt"]] = Attempt(event["attempt"], event["time"], event["resumed_at"],
                                                 str(event["job_id"]), event["restart_count"], event["lost_s"],
                                                 end_time=event.get("end_time"))
        elif event.get("event") == "end" and event.get("attempt") in attempts:
            found = attempts[event["attempt"]]
            found.ended, found.last_step, found.reason = event["time"], event["last_step"], event["reason"]
            if event.get("stop"):
                found.stop = StopRecord.from_json(event["stop"])
        elif event.get("event") == "stop":
            stops.append(event)
    for event in stops:
        _attach_stop(attempts, event)
    return [attempts[k] for k in sorted(attempts)]


def _attach_stop(attempts: dict[int, Attempt], event: dict) -> None:
    """A watchdog's `stop` line to the newest attempt of its job and restart, unless its `end` line
    said how it stopped (the watchdog may give up on a start-up before the attempt's `start`)."""
    for number in sorted(attempts, reverse=True):
        found = attempts[number]
        if found.job_id == str(event.get("job_id")) and found.restart_count == event.get("restart_count"):
            if found.stop is None:
                found.stop = StopRecord.from_json(event["stop"])
            return


def _append(run_dir: Path, event: dict) -> None:
    with open(Path(run_dir) / HISTORY_FILE, "a") as f:
        f.write(json.dumps(event) + "\n")


def time_budget_lines(attempts: Sequence[Attempt], last_row: dict | None, now: float | None = None) -> list[str]:
    """What `verl-hpc status` says about the time limit: the running attempt's end time, the
    estimates the last step logged, and how the latest early stop happened."""
    now = time.time() if now is None else now
    lines = []
    current = attempts[-1] if attempts else None
    if current is not None and current.ended is None and current.end_time:
        left = current.end_time - now
        when = time.strftime("%F %T", time.localtime(current.end_time))
        lines.append(f"time limit:  attempt {current.number} ends {when} "
                     f"({f'{left:.0f} s from now' if left >= 0 else f'{-left:.0f} s ago'})")
    if last_row and "perf/step_estimate_s" in last_row:
        lines.append(f"estimates:   step ~{last_row['perf/step_estimate_s']:.1f} s, save "
                     f"~{last_row.get('perf/save_estimate_s', 0.0):.1f} s (slowest recent, over the trainer "
                     f"ranks, at step {last_row.get('step')})")
    stopped = [a for a in attempts if a.stop is not None]
    if stopped:
        latest = stopped[-1]
        lines.append(f"last stop:   attempt {latest.number} after step {latest.last_step}: {latest.stop.describe()}")
    return lines
