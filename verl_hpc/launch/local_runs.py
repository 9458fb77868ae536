"""The local backends of a `RunHandle`: a run that ran here, a `verl-hpc train` child, a run directory.

Why three: the local executor either runs the run in this process (it has ended when
`submit` returns, and the handle holds its result), or starts `verl-hpc train` as a
child process in the background (the handle polls it); a handle attached later to a
run directory knows only the directory, whose `launcher.json` names the live launcher
and whose checkpoints and `attempts.jsonl` say how it ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from verl_hpc.launch.run_files import (
    LAUNCHER_FILE,
    Backend,
    RunError,
    component,
    live_launcher,
    rank_log_paths,
    run_plan,
)

LAUNCHER_LOG = "launcher.out"  # a background `verl-hpc train`'s own output, beside the workers' logs


def exit_state(code: int | None) -> str:
    """The state a launcher's exit code means: 0 finished, 128+N stopped by signal N, else failed."""
    if code is None:
        return "RUNNING"
    if code == 0:
        return "COMPLETED"
    return "STOPPED" if code > 128 or code < 0 else "FAILED"


def group_states(run_dir: Path, job_id: str, state: str, finished: bool, exit_code: str = "",
                 reason: str = "") -> dict[str, dict[str, Any]]:
    """The same state for every process group of the run's plan (one entry `run` when it is unknown)."""
    plan = run_plan(run_dir)
    names = [g.name for g in plan.groups] if plan is not None else ["run"]
    return {name: component(i, job_id, state, finished, exit_code, "localhost", reason)
            for i, name in enumerate(names)}


def local_log_paths(run_dir: Path, role: str | None, rank: int | None, launcher_log: bool) -> list[Path]:
    """`logs/<group>_rank<N>.out` (a one-process run writes only its `.log`), after the launcher's own output."""
    logs = run_dir / "logs"
    ranks = rank_log_paths(logs, run_plan(run_dir), role, rank)
    if not ranks and rank in (None, 0) and role in (None, "trainer", "actor"):
        ranks = [logs / "trainer_rank0.out"]
    chosen = [p if p.exists() or not p.with_suffix(".log").exists() else p.with_suffix(".log") for p in ranks]
    first = [logs / LAUNCHER_LOG] if launcher_log and role is None and rank is None else []
    return first + chosen


class RanHere(Backend):
    """A run that ran to its end in this process: `result` (or the failure that ended it)."""

    def __init__(self, run_dir: Path, result: Any = None, error: BaseException | None = None):
        self.run_dir, self.result, self.error = Path(run_dir), result, error
        self.folder = self.run_dir / "logs"

    def exit_code(self) -> int:
        if self.error is not None:
            return 1
        stopped = getattr(self.result, "stopped_by", None)
        return 0 if stopped is None else 128 + getattr(signal.Signals, str(stopped), signal.SIGTERM).value

    def states(self) -> dict[str, dict[str, Any]]:
        code = self.exit_code()
        reason = str(self.error).splitlines()[0] if self.error is not None else \
            str(getattr(self.result, "stopped_by", "") or "")
        return group_states(self.run_dir, str(os.getpid()), exit_state(code), True, str(code), reason)

    def cancel(self) -> None:
        """Nothing to stop: the run has ended."""

    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        return local_log_paths(self.run_dir, role, rank, launcher_log=False)


class ChildProcess(Backend):
    """`verl-hpc train` running in the background as a child of this process."""

    def __init__(self, run_dir: Path, process: subprocess.Popen):
        self.run_dir, self.process = Path(run_dir), process
        self.job_id, self.folder = str(process.pid), self.run_dir / "logs"

    @classmethod
    def start(cls, config: str | Path, run_dir: str | Path, overrides: list[str] | None = None,
              env: dict[str, str] | None = None) -> ChildProcess:
        """`verl-hpc train CONFIG --run-dir RUN_DIR OVERRIDES`; its output goes to RUN_DIR/logs/launcher.out.

        Why a child process: the local launcher must own the main thread of its process (it
        forwards Ctrl-C/SIGTERM and relies on a parent-death signal tied to the thread that
        spawned the workers), which a notebook's thread is not.
        """
        run_dir = Path(run_dir).absolute()
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "verl_hpc", "train", str(Path(config).absolute()), "--run-dir",
                   str(run_dir), *(overrides or [])]
        with open(run_dir / "logs" / LAUNCHER_LOG, "ab") as out:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})})
        return cls(run_dir, process)

    def exit_code(self) -> int | None:
        code = self.process.poll()
        return 128 - code if code is not None and code < 0 else code  # killed by a signal: as a shell says

    def states(self) -> dict[str, dict[str, Any]]:
        code = self.exit_code()
        return group_states(self.run_dir, self.job_id or "", exit_state(code), code is not None,
                            "" if code is None else str(code))

    def cancel(self) -> None:
        """SIGTERM, as Ctrl-C: the launcher stops every worker after a checkpoint of the step."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        return local_log_paths(self.run_dir, role, rank, launcher_log=True)


class RunDirectory(Backend):
    """A local run known by its directory only: live while its `launcher.json` names a live process."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / "logs"

    @property
    def job_id(self) -> str | None:
        """The live launcher's pid, while there is one."""
        pid = live_launcher(self.run_dir)
        return None if pid is None else str(pid)

    def _ended(self) -> tuple[str, int]:
        """(state, exit code) of a run with no live launcher: its run state, then its last attempt."""
        from verl_hpc.metrics.history import read_history
        from verl_hpc.runtime.state.run_dir import finished_step

        if finished_step(self.run_dir) is not None:
            return "COMPLETED", 0
        attempts = read_history(self.run_dir)
        reason = attempts[-1].reason if attempts else None
        if reason is not None and reason.startswith("SIG") and hasattr(signal.Signals, reason):
            return "STOPPED", 128 + signal.Signals[reason].value
        return ("FAILED", 1) if attempts else ("UNKNOWN", 1)

    def exit_code(self) -> int | None:
        return None if live_launcher(self.run_dir) is not None else self._ended()[1]

    def states(self) -> dict[str, dict[str, Any]]:
        pid = live_launcher(self.run_dir)
        if pid is not None:
            return group_states(self.run_dir, str(pid), "RUNNING", False)
        state, code = self._ended()
        return group_states(self.run_dir, "", state, True, str(code))

    def cancel(self) -> None:
        """SIGTERM to the run's launcher on this host (what Ctrl-C in its terminal does)."""
        pid = live_launcher(self.run_dir)
        if pid is None:
            raise RunError(f"no process on this host is running {self.run_dir} (its {LAUNCHER_FILE} names "
                           "none that is alive): nothing to cancel")
        os.kill(pid, signal.SIGTERM)

    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        return local_log_paths(self.run_dir, role, rank, launcher_log=(self.folder / LAUNCHER_LOG).exists())
