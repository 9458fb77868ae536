"""The distributed runtime through the CLI: split and colocated learn; a dead worker is named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.test_train_e2e import scalars, window_means

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_placement_trains_and_learns(placement: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.conftest import run_cli

    run_dir = tmp_path / "run"
    proc = run_cli("train", f"configs/quickstart_{placement}.yaml", "--run-dir", str(run_dir),
                   f"model.path={tiny_model_dir}", "trainer.total_steps=200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = scalars(run_dir)
    first, last = window_means(series["critic/score/mean"])
    assert last > first + 0.3, (first, last)
    assert max(series["rollout/policy_lag"]) == 0.0  # on-policy: every batch from the newest weights
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert (run_dir / "secrets" / "flight_token").stat().st_mode & 0o777 == 0o600


def _workers(launcher: psutil.Process) -> dict[int, psutil.Process]:
    found = {}
    for child in launcher.children(recursive=True):
        try:
            rank = child.environ().get("VERL_HPC_RANK")
        except psutil.Error:
            continue
        if rank is not None and "verl_hpc.runtime.worker" in " ".join(child.cmdline()):
            found[int(rank)] = child
    return found


def test_killed_worker_is_named_and_nothing_is_left(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cli = subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", "configs/quickstart_split.yaml",
                            "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", "trainer.total_steps=5000",
                            "resources.timeout_seconds=20"], cwd=REPO, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    launcher = psutil.Process(cli.pid)
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.5)
    workers = _workers(launcher)
    assert sorted(workers) == [0, 1, 2]
    everything = [launcher, *launcher.children(recursive=True)]
    killed_at = time.monotonic()
    os.kill(workers[2].pid, signal.SIGKILL)
    _, stderr = cli.communicate(timeout=20 + 30)
    assert cli.returncode != 0
    assert time.monotonic() - killed_at < 20 + 15
    assert "rollout rank 2" in stderr and "SIGKILL" in stderr, stderr[-2000:]
    time.sleep(1)
    alive = [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
