"""When this attempt must end: the job's end time, from our launcher or from Slurm.

Why the end time and not only a signal: `--signal=B:USR1@N` reaches the job N s +- 30 s
before the limit (slurmctld looks at time limits twice a minute; measured on the local
cluster: `@60` 64-89 s before the end, `@50` in a 1-minute job 37 s before), and the limit
itself is enforced up to 30 s after the end time, never before. A run that knows the end time can stop at the
step boundary where the next step and a checkpoint would no longer fit, whatever the
signal's timing, and can still stop in time when a step or a save is slow.

Sources, first match wins:
- `VERL_HPC_END_TIME` (unix seconds): set by `verl-hpc train --time-limit` for its
  workers, or by a user whose scheduler is not Slurm;
- `SLURM_JOB_END_TIME` (unix seconds): set by Slurm 23.02 and later;
- `scontrol show job $SLURM_JOB_ID`: the `EndTime` of every component (Slurm 22.05 sets no
  variable; measured), the earliest one, since the first component to reach its limit ends
  the step. Only the trainer leader asks: the other ranks get the answer from it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

END_TIME_ENV = "VERL_HPC_END_TIME"
EXIT_AT_DEADLINE = 75  # a local run's leader stopped at its --time-limit deadline (EX_TEMPFAIL: run it again)
SLURM_END_TIME_ENV = "SLURM_JOB_END_TIME"
SCONTROL_TIMEOUT_S = 20.0  # a busy slurmctld answers slowly; the run starts without a deadline after this
_END_TIME = re.compile(r"\bEndTime=(\S+)")
_NO_TIME = {"", "unknown", "none", "n/a", "infinite", "unlimited"}


@dataclass(frozen=True)
class EndTime:
    """The moment the scheduler ends this attempt (unix seconds), and where that came from."""

    at: float | None = None   # None: no limit known (no scheduler limit, or it could not be read)
    source: str = "none"      # VERL_HPC_END_TIME, SLURM_JOB_END_TIME, scontrol, none

    @property
    def known(self) -> bool:
        return self.at is not None

    def left(self, now: float | None = None) -> float:
        """Seconds until the end time (negative once past it); infinity without one."""
        if self.at is None:
            return float("inf")
        return self.at - (time.time() if now is None else now)


def parse_end_time(value: str) -> float | None:
    """`2026-12-04T23:21:14` (scontrol's local time) as unix seconds; None for Unknown/None/N/A.

    scontrol prints local time without a zone; `datetime.timestamp` reads a naive value as
    local time too, so both sides agree on the machine that runs scontrol.
    """
    text = value.strip()
    if text.lower() in _NO_TIME:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        raise ValueError(f"cannot read the end time {value!r} (expected YYYY-MM-DDTHH:MM:SS)") from None


def end_time_from_scontrol(text: str) -> float | None:
    """The earliest `EndTime` in `scontrol show job` output (one record per hetjob component)."""
    times = [t for t in (parse_end_time(m) for m in _END_TIME.findall(text)) if t is not None]
    return min(times) if times else None


def _unix_seconds(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not unix seconds") from None


def job_end_time(environ: Mapping[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> EndTime:
    """This attempt's end time from the environment or from Slurm (see the module docstring).

    A failing scontrol (missing in a container, a controller that does not answer) leaves the
    run without a deadline: the time-limit signal then remains the only notice, as before.
    """
    env = os.environ if environ is None else environ
    for name in (END_TIME_ENV, SLURM_END_TIME_ENV):
        if env.get(name, "").strip():
            return EndTime(_unix_seconds(name, env[name]), name)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    scontrol = shutil.which("scontrol")
    if not job_id or scontrol is None:
        return EndTime()
    try:
        done = run([scontrol, "show", "job", job_id], capture_output=True, text=True,
                   timeout=SCONTROL_TIMEOUT_S, check=False, start_new_session=True)
    except (OSError, subprocess.SubprocessError):
        return EndTime()
    if done.returncode != 0:
        return EndTime()
    try:
        at = end_time_from_scontrol(done.stdout)
    except ValueError:
        return EndTime()
    return EndTime(at, "scontrol") if at is not None else EndTime()


_LIMIT = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_limit(text: str) -> int:
    """Slurm's `--time` formats as seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.

    Why Slurm's: `verl-hpc train --time-limit` takes the same value as `slurm.time`, so a
    run tried locally under the limit of its job behaves as it will under Slurm.
    """
    match = _LIMIT.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a time limit: use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
    days, first, second, third = match.groups()
    numbers = [int(x) for x in (first, second, third) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (numbers + [0, 0])[:3]
        total = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    elif len(numbers) == 1:
        total = numbers[0] * 60
    elif len(numbers) == 2:
        total = numbers[0] * 60 + numbers[1]
    else:
        total = (numbers[0] * 60 + numbers[1]) * 60 + numbers[2]
    if total <= 0:
        raise ValueError(f"time limit {text!r} must be longer than 0 s")
    return total
