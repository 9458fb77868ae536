"""Stop requests: signals set a flag; the trainer acts on it at the next step boundary.

Why only a flag: checkpointing inside a signal handler corrupts state (a collective or a
file write interrupted half-way — Lightning#21406). The handler records which signal
arrived and when; at the end of the step the trainer ranks agree (a MAX all-reduce, so one
rank's signal stops all: runtime/process/deadline.py), save synchronously, tell the other
roles to stop, and — under Slurm — requeue the job.

Which signal means what: SIGUSR1 — the time limit is near (`--signal=B:USR1@grace`,
forwarded to the step by the batch script); SIGTERM — preemption, `scontrol requeue`,
or the local launcher passing on Ctrl-C; SIGUSR2 — submitit's convention; SIGINT — Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from verl_hpc.runtime.process.env import JobEnvironment
from verl_hpc.utils.logging import get_logger

log = get_logger("signals")
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


class StopFlag:
    """Installs handlers that only record the signal; `restore()` puts the old ones back."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: int | None = None        # the first signal
        self.times: dict[int, float] = {}       # every signal received -> when it first came (unix seconds)
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.record(signum)

    def record(self, signum: int, at: float | None = None) -> None:
        """Note `signum` (the handler's only work; also for signals caught before it was installed)."""
        self.times.setdefault(signum, time.time() if at is None else at)
        if self.received is None:
            self.received = signum

    def install(self) -> StopFlag:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    @staticmethod
    def name(signum: int | None) -> str:
        return signal.Signals(signum).name if signum else "none"


EXIT_STOPPED_UNFINISHED = 3  # under Slurm: stopped with a checkpoint, but not requeued


REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def ignore_notices_until_exit(signals: tuple[signal.Signals, ...] = REQUEUE_SIGNALS) -> None:
    """Ignore USR1/USR2 (SIG_IGN) from now until the process is gone; call it as `main` returns.

    Why: CPython's finalization puts SIG_DFL back for every signal with a Python handler
    before its garbage collection and module teardown (1-2 s with torch loaded, longer on
    a busy machine), and the default action of USR1 is to terminate. The batch script
    repeats USR1 to the step every 5 s until the step ends, so a worker that finished
    while a notice was pending could die of "User defined signal 1" on its way out and
    turn a COMPLETED job into a FAILED one. Finalization leaves ignored signals alone.
    TERM keeps its handler (and then the default): it means "end now".
    """
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def requeue(env: JobEnvironment, max_requeues: int, signum: int | None = signal.SIGUSR1) -> tuple[bool, str]:
    """Ask Slurm to requeue this job (leader only): (requeued?, what happened in one line).

    For USR1/USR2 — the time limit is near, or a preemption notice — and for the run's own
    deadline (`signum` None: the next step and a save no longer fit before the end time).
    A TERM alone is `scancel` (the user wants the job to end), or Slurm's own
    requeue/preemption, which requeues the job without our help: requeuing on TERM would
    resurrect cancelled jobs.
    """
    if env.scheduler != "slurm" or not env.job_id:
        return False, "not under Slurm: not requeuing; run the same command again to resume"
    if signum is not None and signum not in REQUEUE_SIGNALS:
        return False, (f"{signal.Signals(signum).name}: cancelled, or requeued by Slurm itself; not requeuing "
                       "(the checkpoint is saved, a requeued job resumes from it)")
    if env.restart_count >= max_requeues:
        return False, (f"slurm.max_requeues={max_requeues} reached (restart {env.restart_count}): not "
                       "requeuing; the checkpoints are kept, resubmit with the same run dir to continue")
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return _ask_batch_shell(env, max_requeues)
    # Its own session: srun relays USR1 to the task's whole process group, and the batch shell
    # repeats it every 5 s; in the worker's group a repeat would kill scontrol mid-request.
    proc = subprocess.run([scontrol, "requeue", env.job_id], capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    if proc.returncode != 0:
        return False, f"scontrol requeue {env.job_id} failed: {proc.stderr.strip() or proc.stdout.strip()}"
    return True, f"requeued job {env.job_id} (restart {env.restart_count + 1} of at most {max_requeues})"


def job_step_ids(environ: Mapping[str, str]) -> list[str]:
    """`<job id>.<step id>` of every hetjob component's part of this step, this task's own last.

    Why per component: in a het step `scancel JOB.STEP` ends only the leader component's part
    (measured on Slurm 22.05); the others run on. Own last: cancelling it ends this process.
    """
    step = environ.get("SLURM_STEP_ID")
    if not step:
        return []
    size = int(environ.get("SLURM_HET_SIZE") or 0)
    ids = [environ.get(f"SLURM_JOB_ID_HET_GROUP_{k}") for k in range(size)]
    ids = [i for i in ids if i] or [environ.get("SLURM_JOB_ID", "")]
    own = environ.get("SLURM_JOB_ID", "")
    ordered = [i for i in ids if i != own] + [i for i in ids if i == own]
    return [f"{i}.{step}" for i in ordered if i]


def end_job_step(environ: Mapping[str, str] | None = None) -> bool:
    """SIGKILL this Slurm job step on every component, so the job ends FAILED now, not TIMEOUT later.

    For a step that cannot finish before the time limit and cannot be requeued: the batch
    script then exits with the step's status. Returns False when there is no step to end.
    """
    env = os.environ if environ is None else environ
    scancel = shutil.which("scancel")
    ids = job_step_ids(env)
    if scancel is None or not ids:
        return False
    # One scancel for all (a process start costs seconds on a loaded node); it signals them in order.
    subprocess.run([scancel, "--signal=KILL", *ids], capture_output=True, text=True, timeout=60,
                   start_new_session=True, check=False)
    return True


def _ask_batch_shell(env: JobEnvironment, max_requeues: int) -> tuple[bool, str]:
    """No scontrol here (a task inside a container image): the batch shell, on the host, requeues.

    The job script of a `slurm.container` run names a request file in VERL_HPC_REQUEUE_REQUEST
    and runs `scontrol requeue` after the step when the file exists (launch/container.py).
    """
    request = os.environ.get("VERL_HPC_REQUEUE_REQUEST")
    if not request:
        return False, ("scontrol is not on PATH (common inside containers): cannot requeue job "
                       f"{env.job_id}; the checkpoint is complete, resubmit with the same run dir (docs/slurm.md)")
    Path(request).write_text(f"{env.job_id}\n")
    return True, (f"asked the batch shell to requeue job {env.job_id} (no scontrol in this container; "
                  f"restart {env.restart_count + 1} of at most {max_requeues})")
