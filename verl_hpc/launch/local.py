"""Run every process of a `ProcessPlan` on this machine and never leave one behind.

Why a launcher of our own instead of `torchrun`: the plan has heterogeneous groups
(trainer, rollout, reward...) whose ranks need their group name and group rank, one GPU
each, a log file per rank that survives retries, and a failure report that names the
role that died and shows its last log lines. `torchrun` gives none of that, and its
restart logic would fight the checkpoint-resume logic of `verl-hpc train`.

Process hygiene is the point of this module:

* Each worker starts in its own session (`start_new_session=True`), hence its own
  process group, so a worker and any helpers it forks can be signalled as one unit,
  and a Ctrl-C at the terminal reaches only the launcher, which then shuts the world
  down in order instead of every process dying at a random point.
* Shutdown collects every descendant with psutil (a worker may have `setsid` helpers
  outside its group) plus every member of the workers' process groups (helpers whose
  parent already died were reparented away from us), sends SIGTERM, waits
  `grace_seconds`, then SIGKILLs whatever is left. This runs on every exit path.
* If the launcher itself is SIGKILLed, no Python code runs, so each worker asks the
  kernel (`prctl(PR_SET_PDEATHSIG, SIGKILL)`) to kill it when its parent dies.
  Caveat: the kernel fires this on the exit of the *thread* that forked the worker,
  not of the process, so `run()` must stay on one long-lived thread (the main thread
  is the intended one). It also covers only the worker itself: a worker's own helpers
  outlive a SIGKILLed launcher unless the worker arranges the same for them. (Setting
  it needs `preexec_fn`, which CPython calls unsafe in a parent with other threads
  that hold locks; our hook calls only a preloaded libc function and os.getppid/kill.)

`run()` must be called from the main thread to forward SIGINT/SIGTERM (Python only
delivers signals there); from another thread it still cleans up on every exit path but
leaves signal handling to the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from verl_hpc.config.placement import ProcessPlan
from verl_hpc.launch.forkserver import ForkServer, forking_wanted
from verl_hpc.launch.log_tail import read_tail
from verl_hpc.launch.relay import LogRelay, announce
from verl_hpc.launch.worker_env import worker_env
from verl_hpc.runtime.process.endtime import END_TIME_ENV, EXIT_AT_DEADLINE
from verl_hpc.runtime.process.env import free_port
from verl_hpc.utils.logging import get_logger

log = get_logger("launch")

_PR_SET_PDEATHSIG = 1
# USR1/USR2 too: a "time is nearly up" notice sent to the launcher must become a checkpointed
# stop of every worker, not the default action (the launcher dies, its workers are SIGKILLed).
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
EXIT_TIME_LIMIT = 124  # `run()` when the time limit ended the workers (as timeout(1) does)


def _load_libc() -> ctypes.CDLL | None:
    """libc is loaded in the parent: the forked child must not import or dlopen anything."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - non-glibc platforms
        return None


_LIBC = _load_libc()


def _pdeathsig_preexec(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn that makes the kernel SIGKILL the child when its spawning thread dies.

    Why the getppid check: if the launcher died between fork and prctl, the signal
    would never come, so the child kills itself instead of running as an orphan.
    """

    def preexec() -> None:
        if _LIBC is not None and hasattr(_LIBC, "prctl"):
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def describe_exit(returncode: int | None) -> str:
    """'exit code 3' or 'killed by SIGKILL': Popen's negative codes mean death by signal."""
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class WorkerFailure(RuntimeError):
    """A worker died; the message names its group (role), rank, cause and last log lines."""

    def __init__(self, group: str, rank: int, returncode: int | None, log_path: Path,
                 last_lines: list[str], also_failed: tuple[str, ...] = ()):
        self.group, self.rank, self.returncode = group, rank, returncode
        self.log_path, self.last_lines, self.also_failed = log_path, last_lines, also_failed
        dead_by_signal = returncode is not None and returncode < 0
        self.signal_name = describe_exit(returncode).removeprefix("killed by ") if dead_by_signal else None
        super().__init__(self._message())

    @property
    def how(self) -> str:
        return describe_exit(self.returncode)

    def _headline(self) -> str:
        return f"{self.group} rank {self.rank} failed: {self.how}"

    def _message(self) -> str:
        text = self._headline()
        if self.also_failed:
            text += f" (also failed: {'; '.join(self.also_failed)})"
        body = "\n".join(f"    {line}" for line in self.last_lines) or "    (log is empty)"
        return f"{text}\nlast {len(self.last_lines)} lines of {self.log_path}:\n{body}"


class LaunchTimeout(WorkerFailure):
    """The world ran past `timeout_seconds`; group/rank/log are those of the lowest rank still running."""

    def __init__(self, timeout_seconds: float, running: list[int], group: str, rank: int,
                 log_path: Path, last_lines: list[str]):
        self.timeout_seconds, self.running = timeout_seconds, running
        super().__init__(group, rank, None, log_path, last_lines)

    @property
    def how(self) -> str:
        return f"still running after the {self.timeout_seconds:g} s launch timeout"

    def _headline(self) -> str:
        return (f"launch timed out after {self.timeout_seconds:g} s with ranks {self.running} still "
                f"running; all processes were killed. First of them: {self.group} rank {self.rank}")


@dataclass
class _Worker:
    rank: int
    group: str
    popen: Any  # subprocess.Popen, or a ForkedWorker (forkserver.py) with the same poll/returncode/pid
    log_path: Path
    log_offset: int

    def failure(self, also_failed: tuple[str, ...] = ()) -> WorkerFailure:
        return WorkerFailure(self.group, self.rank, self.popen.returncode, self.log_path,
                             read_tail(self.log_path, self.log_offset), also_failed)


class LocalLauncher:
    """Spawn one process of `command` per global rank of `plan`, supervise, clean up.

    `run()` returns 0 when every worker exits 0, 128+signum when SIGINT/SIGTERM stopped
    the launcher, EXIT_AT_DEADLINE when the leader stopped early at its deadline (the
    others exiting 0), EXIT_TIME_LIMIT when `end_time` came first (the workers get
    SIGTERM, then SIGKILL after `grace_seconds`, as Slurm's KillWait), and raises
    `WorkerFailure` (or `LaunchTimeout`) otherwise. On every exit path no worker, nor any
    process a worker started, is left running (limits: the module docstring).
    """

    def __init__(self, plan: ProcessPlan, run_dir: Path, command: list[str], env: dict[str, str] | None = None,
                 master_port: int | None = None, grace_seconds: float = 10.0, poll_interval: float = 0.2,
                 timeout_seconds: float | None = None, relay: bool = True, end_time: float | None = None):
        if not command:
            raise ValueError("command must not be empty")
        self.plan, self.run_dir, self.command = plan, Path(run_dir), list(command)
        self.env, self.master_port = env, master_port
        self.grace_seconds, self.poll_interval = grace_seconds, poll_interval
        self.timeout_seconds, self.end_time = timeout_seconds, end_time  # end_time: unix seconds, or None
        self.relay = LogRelay() if relay else None  # progress + start-up lines on our stderr (relay.py)
        self._workers: list[_Worker] = []
        self._forks: ForkServer | None = None
        self._received: int | None = None
        self._signal_count = 0

    @property
    def pids(self) -> dict[int, int]:
        """Global rank -> pid of the workers of the latest run."""
        return {w.rank: w.popen.pid for w in self._workers}

    def log_path(self, rank: int) -> Path:
        group, _ = self.plan.locate(rank)
        return self.run_dir / "logs" / f"{group.name}_rank{rank}.out"

    def run(self) -> int:
        """Spawn, supervise and tear down the world; see the class docstring for results."""
        self._workers, self._received, self._signal_count = [], None, 0
        previous = self._install_handlers()
        if self.relay is not None:
            self.relay = LogRelay(self.relay.stream)  # this attempt's files and offsets only
        try:
            self._spawn_all()
            return self._supervise()
        finally:
            try:
                self._terminate_all()
            finally:
                if self._forks is not None:
                    self._forks.close()
                    self._forks = None
                self._restore_handlers(previous)
                if self.relay is not None:
                    self.relay.pump(final=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        """Only record: the supervise loop forwards it; a second signal skips the grace period."""
        if self._received is None:
            self._received = signum
        self._signal_count += 1

    def _install_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            log.warning("LocalLauncher.run() is not on the main thread: SIGINT/SIGTERM will not be forwarded")
            return {}
        return {int(sig): signal.signal(sig, self._on_signal) for sig in _FORWARDED_SIGNALS}

    @staticmethod
    def _restore_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]

    def _spawn_all(self) -> None:
        port = self.master_port if self.master_port is not None else free_port()
        base_env = {**os.environ, **(self.env or {})}
        if self.end_time is not None:  # the workers stop at a step boundary before it (runtime/process/deadline.py)
            base_env[END_TIME_ENV] = f"{self.end_time:.3f}"
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if forking_wanted({g.resources.device_type for g in self.plan.groups}, self.command, base_env):
            self._forks = ForkServer(base_env, preexec_fn=_pdeathsig_preexec(os.getpid()))
        for rank in range(self.plan.world_size):
            if self._received is not None:
                return  # stopped while spawning: the supervise loop shuts down what exists
            env = worker_env(self.plan, rank, port, self.run_dir, base_env)
            self._workers.append(self._spawn(rank, env))
        log.info("launched %d processes (master port %d), logs in %s",
                 len(self._workers), port, self.run_dir / "logs")
        if self.relay is not None:
            announce(self.relay, self._workers)

    def _spawn(self, rank: int, env: dict[str, str]) -> _Worker:
        """Append mode with a header line: retries share the file, the first attempt's text stays."""
        group, group_rank = self.plan.locate(rank)
        path = self.log_path(rank)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        header = (f"==== verl-hpc launch {stamp}: {group.name} rank {rank} (group rank {group_rank}) "
                  f"of {self.plan.world_size} ====\n")
        with open(path, "ab") as log_file:
            log_file.write(header.encode())
            log_file.flush()
            offset = log_file.tell()
        if self._forks is not None:
            return _Worker(rank, group.name, self._forks.spawn(env, path), path, offset)
        with open(path, "ab") as log_file:
            popen = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_pdeathsig_preexec(os.getpid()))
        return _Worker(rank, group.name, popen, path, offset)

    def _supervise(self) -> int:
        deadline = None if self.timeout_seconds is None else time.monotonic() + self.timeout_seconds
        while True:
            if self.relay is not None:
                self.relay.pump()
            if self._received is not None:
                log.warning("received %s: stopping all workers", signal.Signals(self._received).name)
                self._terminate_all()
                return 128 + self._received
            failed = [w for w in self._workers if w.popen.poll() not in (None, 0, EXIT_AT_DEADLINE)]
            if failed:
                self._raise_failure(failed)
            codes = {w.popen.returncode for w in self._workers}
            if codes <= {0, EXIT_AT_DEADLINE}:
                return max(codes)
            if deadline is not None and time.monotonic() > deadline:
                self._raise_timeout()
            if self.end_time is not None and time.time() >= self.end_time:
                log.warning("the time limit is reached: stopping all workers (the run resumes from its last "
                            "committed checkpoint)")
                self._terminate_all()
                return EXIT_TIME_LIMIT
            time.sleep(self.poll_interval)

    def _raise_failure(self, failed: list[_Worker]) -> None:
        """Report the likeliest root cause: a death by signal (OOM kill, segfault) beats an
        exit code, which is often a reaction to a dead peer; then the lowest rank."""
        failed.sort(key=lambda w: (w.popen.returncode >= 0, w.rank))
        first, others = failed[0], failed[1:]
        also = tuple(f"{w.group} rank {w.rank}: {describe_exit(w.popen.returncode)}" for w in others)
        self._terminate_all()
        raise first.failure(also)

    def _raise_timeout(self) -> None:
        running = [w for w in self._workers if w.popen.poll() is None]
        if not running:
            return  # the last ones exited just now: the next loop turn reports how
        self._terminate_all()
        first = running[0]
        raise LaunchTimeout(float(self.timeout_seconds or 0.0), [w.rank for w in running], first.group,
                            first.rank, first.log_path, read_tail(first.log_path, first.log_offset))

    def _terminate_all(self) -> None:
        """SIGTERM every worker tree, wait up to grace_seconds, SIGKILL the rest. Idempotent."""
        if not self._workers:
            return
        extra = self._collect_extra()
        if any(w.popen.poll() is None for w in self._workers) or extra:
            self._signal_all(signal.SIGTERM, extra)
            self._wait_gone(extra, self.grace_seconds, self._signal_count)
        self._signal_all(signal.SIGKILL, extra)  # also hits group members born since the snapshot
        self._wait_gone(extra, max(5.0, self.poll_interval), None)
        for worker in self._workers:
            if worker.popen.poll() is None:  # pragma: no cover - SIGKILL cannot be ignored
                log.error("rank %d (pid %d) survived SIGKILL", worker.rank, worker.popen.pid)

    def _collect_extra(self) -> list[psutil.Process]:
        """Descendants of live workers (psutil) plus members of the workers' process groups."""
        found: dict[int, psutil.Process] = {}
        for worker in self._workers:
            if worker.popen.poll() is not None:
                continue
            with contextlib.suppress(psutil.Error):
                for proc in psutil.Process(worker.popen.pid).children(recursive=True):
                    found[proc.pid] = proc
        groups = {w.popen.pid for w in self._workers}
        worker_pids = {w.popen.pid for w in self._workers}
        for pid in psutil.pids():
            if pid in found or pid in worker_pids:
                continue
            with contextlib.suppress(OSError, psutil.Error):
                if os.getpgid(pid) in groups:
                    found[pid] = psutil.Process(pid)
        return [p for p in found.values() if _alive(p)]

    def _signal_all(self, sig: signal.Signals, extra: list[psutil.Process]) -> None:
        for worker in self._workers:
            # The group outlives its leader; its id cannot be reused while members remain.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.popen.pid, sig)
        for proc in extra:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)  # psutil refuses if the pid was reused

    def _wait_gone(self, extra: list[psutil.Process], timeout: float, signal_count: int | None) -> bool:
        """Poll until workers are reaped and extras gone; a new signal (if watched) ends the wait."""
        deadline = time.monotonic() + timeout
        while True:
            workers_done = all(w.popen.poll() is not None for w in self._workers)
            if workers_done and not any(_alive(p) for p in extra):
                return True
            if time.monotonic() >= deadline:
                return False
            if signal_count is not None and self._signal_count > signal_count:
                return False
            time.sleep(min(0.05, self.poll_interval))


def _alive(proc: psutil.Process) -> bool:
    """Zombies count as dead: they run nothing and their (possibly absent) reaper is not ours."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
