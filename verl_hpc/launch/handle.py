"""`RunHandle`: one handle on a run, whatever started it (an `Executor`, another shell, Slurm).

Why one: a run is a run directory plus whatever executes it, and what a user asks of it is
the same everywhere — is it going, wait for it, its logs, stop it, its result and metrics,
move a role to other resources, what resizes it went through. Only where the state comes
from differs, and that is the handle's `Backend` (`local_runs.py`: in this process, a
background `verl-hpc train`, a run directory; `slurm_job.py`: a Slurm job through
`scontrol`). submitit has the same split: one `Job` interface, one subclass per executor.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_hpc.launch.run_files import METRICS_FILE, Backend, RunError, last_metrics_step, read_logs
from verl_hpc.runtime.state import resize

if TYPE_CHECKING:
    from verl_hpc.runtime.lifecycle import TrainResult

_JOB_ID = re.compile(r"\s*\d+(\+\d+)?\s*")


class RunHandle:
    """A run: `RunHandle(RUN_DIR_OR_JOB_ID)` finds one; `Executor.submit` returns one it started.

    `status()` is the state of each process group (Slurm's words: RUNNING, COMPLETED,
    FAILED, CANCELLED, ...; a local run: RUNNING, COMPLETED, STOPPED, FAILED, UNKNOWN),
    `wait()` returns the exit code (0: finished), `result()` the `TrainResult`.
    """

    def __init__(self, target: str | Path, backend: Backend | None = None):
        self.backend = backend if backend is not None else find_backend(target)
        self.run_dir: Path | None = self.backend.run_dir

    @classmethod
    def attach(cls, target: str | Path) -> RunHandle:
        """The run in a run directory (local or submitted from here), or the Slurm job with this id."""
        return cls(target)

    lookup = attach  # the name a Slurm job's handle had

    @classmethod
    def start(cls, config: str | Path, run_dir: str | Path, overrides: list[str] | None = None,
              env: dict[str, str] | None = None) -> RunHandle:
        """`verl-hpc train CONFIG --run-dir RUN_DIR OVERRIDES` in the background (`LocalExecutor(background=True)`)."""
        from verl_hpc.launch.local_runs import ChildProcess

        backend = ChildProcess.start(config, run_dir, overrides, env)
        return cls(backend.run_dir or run_dir, backend)

    # --- where and what ------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """`local` or `slurm`."""
        return self.backend.kind

    @property
    def job_id(self) -> str | None:
        """The Slurm job id (a local run: the launcher's pid, when known)."""
        return self.backend.job_id

    @property
    def folder(self) -> Path | None:
        """Where the run's launcher writes: the Slurm job folder, or the run's `logs/`."""
        return self.backend.folder

    def __repr__(self) -> str:
        return f"RunHandle({self.kind}, run_dir={self.run_dir}, job_id={self.job_id})"

    # --- state ---------------------------------------------------------------------------------
    def status(self) -> dict[str, dict[str, Any]]:
        """State per process group: component, job_id, state, restarts, nodes, reason, exit_code, finished."""
        return self.backend.states()

    def finished(self) -> bool:
        """Whether the run is over for good (a requeued Slurm job is not)."""
        return self.backend.exit_code() is not None

    done = finished

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> int:
        """Block until the run is over; its exit code (0: finished). TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.backend.exit_code()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() > deadline:
                states = ", ".join(f"{k}={v['state']}" for k, v in self.status().items())
                raise TimeoutError(f"{self} not finished after {timeout:g} s: {states}")
            time.sleep(poll if self.kind == "slurm" else min(poll, 0.5))

    def result(self, timeout: float | None = None) -> TrainResult:
        """The run's `TrainResult` once it is over (a run that ran in this process: its own, or its error)."""
        from verl_hpc.launch.local_runs import RanHere
        from verl_hpc.launch.train import read_result

        if isinstance(self.backend, RanHere):
            if self.backend.error is not None:
                raise self.backend.error
            return self.backend.result
        code = self.wait(timeout)
        stopped = self.status_reason(code)
        return read_result(self._run_dir(), stopped)

    @staticmethod
    def status_reason(code: int) -> str | None:
        """The signal's name when the exit code says a signal stopped the run."""
        import signal

        try:
            return signal.Signals(code - 128).name if code > 128 else None
        except ValueError:
            return None

    def metrics(self) -> list[dict[str, float]]:
        """Every step's metrics trainer rank 0 logged so far (`tensorboard/metrics.jsonl`)."""
        from verl_hpc.metrics import read_jsonl_metrics

        path = self._run_dir() / METRICS_FILE
        return read_jsonl_metrics(path) if path.exists() else []

    def last_step(self) -> int | None:
        """The last step trainer rank 0 logged, or None before the first one (or an unknown run directory)."""
        return last_metrics_step(self.run_dir / METRICS_FILE) if self.run_dir is not None else None

    # --- logs and stop -------------------------------------------------------------------------
    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        """The run's log files; `role` (actor, rollout, trainer, ...) and `rank` narrow them."""
        return self.backend.log_paths(role, rank)

    def logs(self, role: str | None = None, rank: int | None = None) -> str:
        """The selected log files' text, each under a `==> path <==` line (as `tail` does)."""
        return read_logs(self.log_paths(role, rank))

    def cancel(self) -> None:
        """Stop the run: scancel a Slurm job; SIGTERM a local launcher (a checkpoint of the step first)."""
        self.backend.cancel()

    # --- resources -----------------------------------------------------------------------------
    def update_resource(self, component: str, device_ids: list[int] | None = None, strategy: str | None = None,
                        **fields: Any) -> Path:
        """Ask the run to move `component` (a role) to new resources at its next step boundary.

        Returns the request file. The run checkpoints, stops and restarts with the new
        resources; the step counter continues (docs/elastic.md).
        Example: `handle.update_resource("reward", device_ids=[3, 4], strategy="data_parallel")`.
        """
        overrides = resize.overrides_for(component, device_ids=device_ids, strategy=strategy, **fields)
        return resize.request_resize(self._run_dir(), overrides)

    def history(self) -> list[dict[str, Any]]:
        """Every resize applied so far (config_history.yaml), oldest first."""
        return resize.history(self._run_dir())

    def _run_dir(self) -> Path:
        if self.run_dir is None:
            raise RunError(f"the run directory of job {self.job_id} is unknown (it was not submitted from here "
                           "and its batch log is not in one)")
        return self.run_dir


def find_backend(target: str | Path) -> Backend:
    """A Slurm job id -> its job; a run directory -> its newest Slurm job from here, else the local run."""
    from verl_hpc.launch.local_runs import RunDirectory
    from verl_hpc.launch.run_files import live_launcher

    if _JOB_ID.fullmatch(str(target)) and not Path(str(target)).is_dir():
        from verl_hpc.launch.slurm_job import SlurmBackend

        return SlurmBackend.lookup(str(target))
    run_dir = Path(target).absolute()
    if not run_dir.is_dir():
        raise RunError(f"{str(target)!r} is not a Slurm job id (a number, e.g. 1234), nor a run directory")
    if live_launcher(run_dir) is None and (run_dir / "slurm").is_dir():
        from verl_hpc.launch.slurm_job import SlurmBackend

        job = SlurmBackend.newest_for(run_dir)
        if job is not None:
            return job
    return RunDirectory(run_dir)
