"""`verl-hpc submit` on a real Slurm: one hetjob, one process group, learning, status/logs/cancel.

Every job here runs the real runtime on the local cluster of tools/slurm-local (4 fake nodes on
this machine): the quickstart task as 3 hetjob components, the sweep example through the Python
API, and each template in sbatch/ with plain `sbatch`. Jobs are short (tens of steps) except
the one that must show learning.
"""

from __future__ import annotations

import json
import os
import re
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
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
TEMPLATES = {"ppo_split_hetjob": "slurm_ppo_split", "grpo_colocated": "slurm_grpo_colocated",
             "multinode": "slurm_multinode"}


@pytest.fixture(scope="module")
def setting(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A tiny model and a private job registry (XDG_CACHE_HOME) for this module's jobs."""
    from verl_hpc.models.tiny import init_model

    root = tmp_path_factory.mktemp("submit")
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    try:
        yield {"root": root, "model": init_model(root / "tiny", preset="tiny", seed=0)}
    finally:
        if previous is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = previous


def cli(*args: str, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "verl_hpc", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def submit_cli(config: str, run_dir: Path, *overrides: str) -> int:
    done = cli("submit", config, "--run-dir", str(run_dir), *overrides)
    assert done.returncode == 0, done.stderr
    match = re.search(r"^submitted job (\d+)$", done.stdout, re.M)
    assert match and f"run dir:    {run_dir}" in done.stdout, done.stdout
    return int(match.group(1))


def finished(slurm_cluster: SlurmCluster, job: int) -> bool:
    states = slurm_cluster.job_states(job)
    return bool(states) and set(states) <= DONE


def metric(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


@pytest.fixture(scope="module")
def learned(slurm_cluster: SlurmCluster, setting: dict) -> dict:
    """configs/slurm_local.yaml submitted with `verl-hpc submit` and run to its end."""
    run_dir = setting["root"] / "learn"
    job = submit_cli("configs/slurm_local.yaml", run_dir, f"model.path={setting['model']}")
    records = slurm_cluster.job_records(job)  # right after submission: the layout as submitted
    assert slurm_cluster.wait_for(lambda: finished(slurm_cluster, job), timeout=300), \
        slurm_cluster.job_records(job)
    return {"job": job, "run_dir": run_dir, "records": records}


def test_submit_runs_one_hetjob_that_learns(slurm_cluster: SlurmCluster, learned: dict, setting: dict) -> None:
    job, run_dir = learned["job"], learned["run_dir"]
    records = learned["records"]
    assert [r.get("HetJobOffset") for r in records] == ["0", "1", "2"], records
    assert [r.get("NumTasks") for r in records] == ["2", "1", "1"]
    final = slurm_cluster.job_records(job)
    assert {r["JobState"] for r in final} == {"COMPLETED"}, final
    assert len({r["NodeList"] for r in final}) == 3
    # Exactly the script `verl-hpc sbatch` prints for the same arguments went to sbatch.
    printed = cli("sbatch", "configs/slurm_local.yaml", "--run-dir", str(run_dir), f"model.path={setting['model']}")
    assert (run_dir / "slurm" / f"{job}_submission.sh").read_text() == printed.stdout
    # Every task joined one world: same rendezvous, 4 ranks, the hetjob's component sizes.
    envs = [json.loads(p.read_text()) for p in sorted((run_dir / "logs").glob("env_*_rank*.json"))]
    derived = [e["derived"] for e in envs]
    assert sorted(d["rank"] for d in derived) == [0, 1, 2, 3]
    assert {(d["master_addr"], d["master_port"], d["world_size"], d["scheduler"]) for d in derived} == {
        ("127.0.0.1", derived[0]["master_port"], 4, "slurm")}
    assert {tuple(d["het_group_sizes"]) for d in derived} == {(2, 1, 1)}
    scores = metric(run_dir, "critic/score/mean")
    assert len(scores) == 150
    fifth = len(scores) // 5
    first, last = sum(scores[:fifth]) / fifth, sum(scores[-fifth:]) / fifth
    assert last > first + 0.2, (first, last)
    logs = sorted(p.name for p in (run_dir / "slurm" / "logs").glob("*.out"))
    assert logs == ["reward_rank3.out", "rollout_rank2.out", "trainer_rank0.out", "trainer_rank1.out"]
    assert "job step exited with status 0" in (run_dir / "slurm" / f"{job}_batch.out").read_text()
    # Every CPU task restarted itself under TCMalloc (resources.host_allocator: auto; `submit` does not preload).
    for log in sorted((run_dir / "logs").glob("*_rank*.log")):
        assert "host allocator tcmalloc (libtcmalloc" in log.read_text(), log


def test_status_and_logs(learned: dict) -> None:
    job, run_dir = str(learned["job"]), learned["run_dir"]
    status = cli("status", job)
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines()[2:5]]
    assert [(row[1], row[3], row[4]) for row in rows] == [
        ("trainer", "COMPLETED", "0"), ("rollout", "COMPLETED", "0"), ("reward", "COMPLETED", "0")]
    assert "last step: 150" in status.stdout and str(run_dir) in status.stdout
    rollout = cli("logs", job, "--role", "rollout")
    assert rollout.returncode == 0 and "rollout_rank2.out <==" in rollout.stdout
    assert "trainer_rank0.out" not in rollout.stdout
    rank0 = cli("logs", job, "--rank", "0").stdout
    assert "trainer_rank0.out <==" in rank0 and f"==== verl-hpc job {job} restart 0" in rank0
    everything = cli("logs", job, "-f")  # the job is finished: prints everything and returns
    assert everything.returncode == 0 and f"{job}_batch.out <==" in everything.stdout
    assert everything.stdout.count("<==") == 5
    bad = cli("logs", job, "--role", "critic")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no role or group 'critic'" in bad.stderr


def test_cancel_a_running_job(slurm_cluster: SlurmCluster, setting: dict) -> None:
    run_dir = setting["root"] / "cancel"
    job = submit_cli("configs/slurm_local.yaml", run_dir, f"model.path={setting['model']}",
                     "trainer.total_steps=100000")
    log = run_dir / "slurm" / "logs" / "trainer_rank0.out"
    assert slurm_cluster.wait_for(log.exists, timeout=60), slurm_cluster.job_records(job)
    running = cli("status", str(job))
    assert running.returncode == 0 and running.stdout.count("RUNNING") == 3, running.stdout
    cancelled = cli("cancel", str(job))
    assert cancelled.returncode == 0 and f"cancelled job {job}" in cancelled.stdout
    # The workers save a checkpoint on the TERM before they go: allow for a loaded machine.
    assert slurm_cluster.wait_for(lambda: finished(slurm_cluster, job), timeout=180), \
        slurm_cluster.job_records(job)
    assert set(slurm_cluster.job_states(job)) == {"CANCELLED"}


def test_sweep_example_submits_through_the_python_api(setting: dict) -> None:
    out = setting["root"] / "sweep"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "examples/sweep_lr.py", "--out", str(out), "--lrs", "1e-3", "3e-4",
                           "--timeout", "240", f"model.path={setting['model']}", "trainer.total_steps=10"],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    finals = re.findall(r"^lr=(\S+): job \d+ COMPLETED, final critic/score/mean (\d\.\d+)$", done.stdout, re.M)
    assert [lr for lr, _ in finals] == ["0.001", "0.0003"], done.stdout
    for lr in ("0.001", "0.0003"):
        cfg = (out / f"lr{lr}" / "config.yaml").read_text()
        assert f"lr: {float(lr)}" in cfg or f"lr: {lr}" in cfg


def test_each_template_runs_with_plain_sbatch(slurm_cluster: SlurmCluster, setting: dict) -> None:
    work = setting["root"] / "templates"
    work.mkdir()
    jobs = {}
    for template, config in TEMPLATES.items():
        run_dir = work / template
        prepared = cli("sbatch", f"configs/{config}.yaml", "--run-dir", str(run_dir), "--prepare",
                       f"model.path={setting['model']}")
        assert prepared.returncode == 0, prepared.stderr
        env = {**os.environ, "VERL_HPC_RUN_DIR": str(run_dir), "VERL_HPC_PYTHON": sys.executable}
        done = subprocess.run(["sbatch", "--parsable", str(REPO / "sbatch" / f"{template}.sbatch")], cwd=work,
                              env=env, text=True, capture_output=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        jobs[template] = int(done.stdout.strip().split(";")[0])
    assert slurm_cluster.wait_for(lambda: all(finished(slurm_cluster, j) for j in jobs.values()), timeout=300)
    for template, job in jobs.items():
        records = slurm_cluster.job_records(job)
        batch_log = next(work.glob(f"*-{job}.out"))  # the template's --output=%x-%j.out
        assert {r["JobState"] for r in records} == {"COMPLETED"}, (template, batch_log.read_text())
        assert metric(work / template, "critic/score/mean") and len(metric(work / template, "critic/score/mean")) == 20
        assert "job step exited with status 0" in batch_log.read_text()
