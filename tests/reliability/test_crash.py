"""kill -9 of one rank of any role under the local launcher: a named failure within
`resources.timeout_seconds`, no process left behind, and the same command resumes from the
newest committed checkpoint. (tests/e2e/test_dist_e2e.py kills the rollout rank and hangs one.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, worker_processes
from tests.reliability.runs import metrics, train

pytestmark = pytest.mark.slow
TIMEOUT_S = 20
ARGS = ("trainer.total_steps=40", "checkpoint.interval_steps=3", f"resources.timeout_seconds={TIMEOUT_S}")


def _newest_committed(run_dir: Path) -> int:
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if (p / "manifest.json").is_file()]
    return max(steps, default=0)


def _start_split(run_dir: Path, model: Path) -> tuple[subprocess.Popen, dict[int, psutil.Process], list]:
    """The split quickstart (actor ranks 0-1, rollout 2, reward 3), once a checkpoint is committed."""
    cli = subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", "configs/quickstart_split.yaml",
                            "--run-dir", str(run_dir), f"model.path={model}", "logging.progress=off",
                            "trainer.save_hf_model=false", *ARGS], cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and _newest_committed(run_dir) < 3:
        time.sleep(0.05)
    launcher = psutil.Process(cli.pid)
    return cli, worker_processes(launcher, run_dir), [launcher, *launcher.children(recursive=True)]


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    time.sleep(1)
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(("rank", "role"), [(0, "trainer"), (3, "reward")])
def test_kill_9_of_one_rank_is_named_and_the_next_start_resumes(tmp_path: Path, tiny_model_dir: Path,
                                                                  rank: int, role: str) -> None:
    run_dir = tmp_path / "run"
    cli, workers, everything = _start_split(run_dir, tiny_model_dir)
    assert sorted(workers) == [0, 1, 2, 3]
    killed_at = time.monotonic()
    os.kill(workers[rank].pid, signal.SIGKILL)
    _, stderr = cli.communicate(timeout=TIMEOUT_S + 60)
    assert cli.returncode == 1, stderr[-3000:]
    assert time.monotonic() - killed_at < TIMEOUT_S + 15
    assert f"{role} rank {rank}" in stderr and "SIGKILL" in stderr, stderr[-3000:]
    assert not _alive(everything)

    committed = _newest_committed(run_dir)
    proc = train(run_dir, tiny_model_dir, *ARGS, config="configs/quickstart_split.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{committed:08d}'}" in log
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 41))
