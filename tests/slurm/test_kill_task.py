"""kill -9 of one rank inside a real Slurm job: a named failure, no orphans, and a resume.

The surviving ranks find out in their next collective (a lost peer, or the timeout) and
fail naming the rank whose heartbeat stopped; the batch script copies that line and the
rank-to-role map into the batch log. The next submission of the same run resumes from
the last committed checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest
from test_requeue import finish, steps_done, submit

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TIMEOUT_S = 20


def _run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process started for this run (workers carry VERL_HPC_RUN_DIR)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("VERL_HPC_RUN_DIR") == str(run_dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("crash") / "tiny", preset="tiny", seed=0)


def test_killed_rollout_task_is_named_leaves_nothing_and_the_run_resumes(slurm_cluster: SlurmCluster, model: Path,
                                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "crashed"
    overrides = ("trainer.total_steps=150", f"resources.timeout_seconds={TIMEOUT_S}")
    job = submit(run_dir, model, *overrides)
    assert slurm_cluster.wait_for(lambda: steps_done(run_dir) >= 12, timeout=240)
    victim = json.loads((run_dir / "logs" / "env_rollout_rank2.json").read_text())["pid"]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    records = finish(slurm_cluster, job, timeout=TIMEOUT_S + 60)
    assert time.monotonic() - killed_at < TIMEOUT_S + 30
    assert {r["JobState"] for r in records} == {"FAILED"}, records
    batch_log = (run_dir / "slurm" / f"{job}_batch.out").read_text()
    assert "verl-hpc: global ranks: 0-1 trainer (actor, ref); 2 rollout (rollout)" in batch_log, batch_log[-3000:]
    assert "verl-hpc: suspect: rollout rank 2" in batch_log, batch_log[-3000:]  # named by the survivors
    time.sleep(2)
    assert not _run_processes(run_dir)  # no worker outlived the step
    committed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert committed, "a checkpoint every 10 steps: at least step 10 was committed"
    last = int(committed[-1].split("_")[1])

    again = submit(run_dir, model, *overrides)
    records = finish(slurm_cluster, again, timeout=400)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    steps = [json.loads(line)["step"] for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 150 and sorted(set(steps)) == list(range(1, 151))
    trainer_log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / committed[-1]} at step {last}" in trainer_log
