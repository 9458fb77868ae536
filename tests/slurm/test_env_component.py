"""Environment workers as a hetjob component of their own (`resources.env`), on the local Slurm cluster.

configs/slurm_env_box.yaml: the trainer (actor and rollout colocated) is component 0; two
environment workers are component 1, on another node, with no GPUs. The job trains, is requeued
mid-run with `scontrol requeue`, and resumes: every step's numbers equal the same config run
uninterrupted by the local launcher, where the rollout starts its environment workers itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.slurm.test_requeue import cli, finish, steps_done, submit

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
CONFIG = "configs/slurm_env_box.yaml"
STEPS = 12
VOLATILE = ("timing_s/", "perf/", "memory/", "env/time_s", "agent/tool_time_s")  # wall times


def stable(run_dir: Path) -> list[dict]:
    lines = (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in lines if line]


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("env-component") / "tiny-agent", preset="tiny-agent", seed=0)


def test_an_env_component_on_its_own_node_trains_is_requeued_and_resumes_exactly(
        slurm_cluster: SlurmCluster, agent_model: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = cli("train", CONFIG, "--run-dir", str(reference), f"model.path={agent_model}", "logging.progress=off")
    assert done.returncode == 0, done.stderr[-3000:]
    expected = stable(reference)
    assert len(expected) == STEPS and any(row["env/steps/mean"] > 0 for row in expected)

    run_dir = tmp_path / "slurm"
    job = submit(run_dir, agent_model, config=CONFIG)
    assert slurm_cluster.wait_for(lambda: steps_done(run_dir) >= 5, timeout=300)
    slurm_cluster.run("scontrol", "requeue", str(job))  # SIGTERM to every task of both components
    records = finish(slurm_cluster, job)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert int(records[0]["Restarts"]) >= 1 and len(records) == 2
    trainer_node, env_node = records[0]["NodeList"], records[1]["NodeList"]
    assert trainer_node != env_node  # a node of its own
    assert "gpu" not in records[1].get("TresPerNode", "") + records[1].get("TRES", "")
    attempts = sorted(p.name for p in (run_dir / "env_workers").iterdir())
    assert attempts[:2] == [f"{job}.0", f"{job}.1"]  # each attempt's workers announced themselves apart
    assert all(len(list((run_dir / "env_workers" / a).glob("worker*.json"))) == 2 for a in attempts)
    got = stable(run_dir)
    assert got == expected  # every step once, every number equal
    assert all(row["env/failures"] == 0 for row in got)
    status = cli("status", str(job))
    assert status.returncode == 0 and "env" in status.stdout, status.stdout
