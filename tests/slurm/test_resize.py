"""`verl-hpc resize` on a running Slurm job: actor 1 -> 2 tasks, a resubmitted job that resumes.

A Slurm job cannot change its shape, so the resized run is a new job: the old one checkpoints at
a step boundary and ends COMPLETED after its batch script submitted the new one, which resumes
from that checkpoint (resharded from 1 actor rank to 2) and finishes the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEPS = 12
BOUNDARY = 3
# The reward function: while scoring step BOUNDARY it runs `verl-hpc resize $SLURM_JOB_ID ...`, as a
# user would from a login node, so the resize lands at a known step instead of racing the run.
RESIZING_REWARD = '''
import os, subprocess, sys
from verl_hpc.data.tasks.arithmetic import score as exact
CALLS = [0]
def score(prompt, response, ground_truth, **_):
    CALLS[0] += 1
    if CALLS[0] == int(os.environ["RESIZE_AT_CALL"]):
        try:
            os.close(os.open(os.environ["RESIZE_MARKER"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return exact(prompt=prompt, response=response, ground_truth=ground_truth)  # ask once
        done = subprocess.run([sys.executable, "-m", "verl_hpc", "resize", os.environ["SLURM_JOB_ID"],
                               "actor.device_ids=[0,1]"], capture_output=True, text=True, timeout=60)
        with open(os.environ["RESIZE_MARKER"], "w") as f:
            f.write(f"{done.returncode}\\n{done.stdout}{done.stderr}")
    return exact(prompt=prompt, response=response, ground_truth=ground_truth)
'''


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "verl_hpc", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


@pytest.fixture()
def registry(tmp_path: Path) -> Iterator[None]:
    """A private job registry, so `verl-hpc resize JOB_ID` finds this test's run directory."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    yield
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def finished(cluster: SlurmCluster, job: int) -> bool:
    states = cluster.job_states(job)
    return bool(states) and set(states) <= DONE


def test_resize_actor_from_one_to_two_tasks_across_a_resubmission(slurm_cluster: SlurmCluster, registry: None,
                                                                  tmp_path: Path) -> None:
    from verl_hpc.models.tiny import init_model
    from verl_hpc.runtime.state import resize

    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    run_dir, marker = tmp_path / "run", tmp_path / "resize.out"
    (tmp_path / "reward.py").write_text(RESIZING_REWARD)
    os.environ.update(RESIZE_AT_CALL=str((BOUNDARY - 1) * 128 + 1), RESIZE_MARKER=str(marker))  # sbatch exports it
    try:
        submitted = cli("submit", "configs/slurm_local.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                        f"trainer.total_steps={STEPS}", "logging.progress=off", "trainer.save_hf_model=false",
                        f"reward.function={tmp_path / 'reward.py'}:score", "resources.actor.device_ids=[0]")
    finally:
        del os.environ["RESIZE_AT_CALL"], os.environ["RESIZE_MARKER"]
    assert submitted.returncode == 0, submitted.stderr
    first = int(next(line.split()[-1] for line in submitted.stdout.splitlines() if line.startswith("submitted job")))

    assert slurm_cluster.wait_for(lambda: finished(slurm_cluster, first), timeout=300), cli("logs", str(first)).stdout
    assert marker.read_text().startswith("0\n") and "resize recorded" in marker.read_text(), marker.read_text()
    assert set(slurm_cluster.job_states(first)) == {"COMPLETED"}
    batch_log = (run_dir / "slurm" / f"{first}_batch.out").read_text()
    second = int(batch_log.strip().splitlines()[-1])  # `verl-hpc resubmit` prints the new job id last
    assert second != first
    assert slurm_cluster.wait_for(lambda: finished(slurm_cluster, second), timeout=400), cli("logs", str(second)).stdout
    records = slurm_cluster.job_records(second)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert [r["NumTasks"] for r in records][0] == "2"  # the trainer component now runs 2 tasks

    [entry] = resize.history(run_dir)
    assert entry["after_step"] == BOUNDARY
    assert entry["world_size"] == {"before": 3, "after": 4}
    assert entry["before"]["actor"]["device_ids"] == [0] and entry["after"]["actor"]["device_ids"] == [0, 1]
    assert steps(run_dir) == list(range(1, STEPS + 1))  # resumed after the boundary: no gap, no repeat
    trainer_ranks = sorted(p.name for p in (run_dir / "logs").glob("env_trainer_rank*.json"))
    assert trainer_ranks == ["env_trainer_rank0.json", "env_trainer_rank1.json"]
    rank1 = json.loads((run_dir / "logs" / "env_trainer_rank1.json").read_text())
    assert str(rank1["derived"]["job_id"]) == str(second)
    status = cli("status", str(second))
    assert status.returncode == 0 and "actor" in status.stdout and "[0, 1]" in status.stdout, status.stdout
