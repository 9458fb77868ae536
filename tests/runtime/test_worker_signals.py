"""A worker never dies of SIGUSR1, not even on its way out (the requeue-test flake).

Under Slurm the batch shell repeats USR1 to the job step every 5 s until the step ends
(a notice sent before the workers were ready must not be lost). CPython's finalization
puts SIG_DFL back for every signal that has a Python handler *before* the garbage
collection and module teardown (seconds with torch loaded on a busy machine), and the
default action of USR1 is to terminate: a worker that finished its run while a notice
was pending died of "User defined signal 1" and the job ended FAILED instead of
COMPLETED. The tests send USR1 from inside that window, so the outcome is deterministic.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USR1_BIT = 1 << (signal.SIGUSR1 - 1)  # in /proc/PID/status masks
# Runs at interpreter finalization (module teardown), after CPython's signal clean-up:
# sends USR1 to its own process and says whether it lived through it.
LATE_USR1 = """
import os, signal
class _Late:
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGUSR1, write=os.write):
        kill(pid, sig)
        write(1, b"survived the late USR1\\n")
_late = _Late()
"""


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=120,
                          env={**os.environ, **(env or {})}, check=False)


def test_a_recording_handler_does_not_protect_the_exit() -> None:
    """The window exists: StopFlag's handler is gone by the time the process tears down."""
    code = LATE_USR1 + "from verl_hpc.runtime.process.signals import StopFlag\nStopFlag().install()\n"
    done = run_python(code)
    assert done.returncode == -signal.SIGUSR1, (done.returncode, done.stderr[-2000:])
    assert "survived" not in done.stdout


def test_ignore_notices_until_exit_closes_the_window() -> None:
    code = (LATE_USR1 + "from verl_hpc.runtime.process.signals import StopFlag, ignore_notices_until_exit\n"
            "StopFlag().install()\nignore_notices_until_exit()\n")
    done = run_python(code)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "survived the late USR1" in done.stdout


def test_worker_entry_point_survives_usr1_while_exiting(tmp_path: Path) -> None:
    """The real `python -m verl_hpc.runtime.worker` path, ending early (no config.yaml) so it is quick."""
    code = LATE_USR1 + ("import runpy\nrunpy.run_module('verl_hpc.runtime.worker', run_name='__main__', "
                        "alter_sys=True)\n")
    done = run_python(code, env={"VERL_HPC_RUN_DIR": str(tmp_path), "VERL_HPC_LOG_DIR": ""})
    assert done.returncode != -signal.SIGUSR1, done.stderr[-2000:]
    assert done.returncode == 1 and "config.yaml" in done.stderr, (done.returncode, done.stderr[-2000:])
    assert "survived the late USR1" in done.stdout


def test_requeue_runs_scontrol_outside_the_ranks_process_group(tmp_path: Path, monkeypatch) -> None:
    """srun relays USR1 to a task's whole process group (measured on the local cluster) and the batch
    shell repeats it: in the rank's group, a repeat would kill `scontrol requeue` mid-request."""
    from verl_hpc.runtime.process.env import JobEnvironment
    from verl_hpc.runtime.process.signals import requeue

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$(ps -o pgid= $$) $*" > {tmp_path / "called"}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                         master_port=29500, job_id="42", restart_count=0, scheduler="slurm", hostname="node1")
    requeued, message = requeue(env, max_requeues=3, signum=signal.SIGUSR1)
    assert requeued, message
    pgid, args = (tmp_path / "called").read_text().split(maxsplit=1)
    assert args.strip() == "requeue 42"
    assert int(pgid) != os.getpgrp()


def _task_command() -> list[str]:
    """The command srun starts on every node, from the rendered template (wrapper included)."""
    line = next(line for line in (REPO / "sbatch" / "grpo_colocated.sbatch").read_text().splitlines()
                if line.startswith("srun ") and "verl_hpc.runtime.worker" in line)
    words = shlex.split(line.removesuffix("&"))
    words = words[words.index("bash"):]
    return [sys.executable if w == "$VERL_HPC_PYTHON" else w for w in words]


def _ignores_usr1(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return bool(int(masks.get("SigIgn", "0"), 16) & USR1_BIT or int(masks.get("SigCgt", "0"), 16) & USR1_BIT)


def test_a_task_started_as_srun_starts_it_survives_usr1_every_few_ms(tmp_path: Path) -> None:
    """From the wrapper's `trap` (a few ms after exec) to the last instruction of the process: the
    Python start-up and the imports (seconds under load), the hand-over of handlers, and the exit."""
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(VERL_HPC_RUN_DIR=str(tmp_path), VERL_HPC_LOG_DIR=str(logs))
    proc = subprocess.Popen(_task_command(), cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not _ignores_usr1(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    sent = 0
    while proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != -signal.SIGUSR1, f"killed by USR1 number {sent}: {err[-2000:]}"
    assert proc.returncode == 1 and "config.yaml" in err, (proc.returncode, err[-2000:])
    assert sent > 20  # the storm covered the process's life (seconds of imports), not just its last moment
    assert [p.name for p in logs.iterdir()] == [".usr1_ready_0_0_0"]  # what the batch shell waits for


def test_exit_now_flushes_logs_and_output_and_skips_finalization(tmp_path: Path) -> None:
    """A finished worker leaves by `exit_now`: its code, its buffered lines and log records all
    arrive, and no teardown code runs after it (the native-thread crashes lived there)."""
    log_file = tmp_path / "rank.log"
    code = LATE_USR1.replace("survived the late USR1", "finalization ran") + (
        "import logging, sys\n"
        f"logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO)\n"
        "from verl_hpc.utils.proc import exit_now\n"
        "logging.getLogger('worker').info('the last record')\n"
        "sys.stdout.write('buffered, no newline')\n"
        "exit_now(3)\n")
    done = run_python(code)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert done.stdout == "buffered, no newline"
    assert "the last record" in log_file.read_text()
