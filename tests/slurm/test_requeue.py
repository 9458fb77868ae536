"""Preemption, `scontrol requeue` and the time limit on a real Slurm: checkpoint, requeue, resume.

Each interrupted job must end COMPLETED after at least one restart with exactly the per-step
metrics of the same config run uninterrupted by the local launcher (same ranks, same seeds),
so no step is lost or computed twice. `slurm.max_requeues` bounds the loop. The time-limit
tests run beside a CPU hog (`cpu_hog`): a busy node is where a fixed signal lead failed, and
where the deadline (runtime/process/deadline.py) must stop the run in time.
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
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
VOLATILE = ("timing_s/", "perf/", "memory/")
# The time-limit tests run on a machine at least this busy (runnable processes per core, beyond the
# test's own job): busy loops make up what other work does not. On an idle 2-core machine three
# loops run; in CI the other test sessions already load the cores that much and none is added (one
# loop there took a whole core from the rest of the suite for the ~10 minutes these tests run).
HOG_LOAD_PER_CORE = 1.5
HOG_SECONDS = 1800   # each ends by itself after this, whatever happens to the test
BUSY_LOOP = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "verl_hpc", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def stable(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows(run_dir)]


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """Busy loops that bring the machine up to HOG_LOAD_PER_CORE for the test, bounded in time."""
    cores = os.cpu_count() or 1
    missing = max(0, round(HOG_LOAD_PER_CORE * cores - os.getloadavg()[0]))
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=HOG_SECONDS)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(missing)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)


def stops(run_dir: Path) -> list:
    """Each attempt's early stop (StopRecord) as attempts.jsonl tells it, None for one that did not stop early."""
    from verl_hpc.metrics.history import read_history

    return [a.stop for a in read_history(run_dir)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("requeue") / "tiny", preset="tiny", seed=0)


_REFERENCES: dict[tuple, list[dict]] = {}


def reference(tmp: Path, model: Path, steps: int, *overrides: str, config: str = "configs/slurm_local.yaml") -> list[dict]:
    """The same config, uninterrupted, through the local launcher; run once per module for each set
    of arguments (the preemption and the requeue tests compare with the same 60-step run)."""
    key = (str(model), steps, overrides, config)
    if key not in _REFERENCES:
        run_dir = tmp / f"reference{steps}"
        done = cli("train", config, "--run-dir", str(run_dir), f"model.path={model}", f"trainer.total_steps={steps}",
                   "checkpoint.interval_steps=10", "logging.progress=off", *overrides)
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCES[key] = stable(run_dir)
    return [dict(row) for row in _REFERENCES[key]]


def submit(run_dir: Path, model: Path, *overrides: str, config: str = "configs/slurm_local.yaml") -> int:
    done = cli("submit", config, "--run-dir", str(run_dir), f"model.path={model}",
               "checkpoint.interval_steps=10", "logging.progress=off", *overrides)
    assert done.returncode == 0, done.stderr
    return int(next(line.split()[-1] for line in done.stdout.splitlines() if line.startswith("submitted job")))


def steps_done(run_dir: Path) -> int:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def finish(cluster: SlurmCluster, job: int, timeout: float = 400) -> list[dict[str, str]]:
    assert cluster.wait_for(lambda: set(cluster.job_states(job)) <= DONE and cluster.job_states(job) != [],
                            timeout=timeout), cluster.job_records(job)
    return cluster.job_records(job)


def restart_counts(run_dir: Path) -> set[int]:
    files = (run_dir / "logs").glob("env_*_rank*.json")
    return {int(json.loads(f.read_text())["derived"]["restart_count"]) for f in files}


def test_preemption_checkpoints_requeues_and_resumes_exactly(slurm_cluster: SlurmCluster, model: Path,
                                                             tmp_path: Path) -> None:
    expected = reference(tmp_path, model, 60)
    run_dir = tmp_path / "preempted"
    job = submit(run_dir, model, "trainer.total_steps=60")
    assert slurm_cluster.wait_for(lambda: steps_done(run_dir) >= 12, timeout=240)
    # A job in the high partition that wants every node preempts ours (USR1 now, TERM after 15 s).
    slurm_cluster.sbatch("-p", "high", "-N4", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 2")
    records = finish(slurm_cluster, job)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert int(records[0]["Restarts"]) >= 1
    assert 1 in restart_counts(run_dir)  # the workers saw SLURM_RESTART_COUNT=1 when they came back
    assert stable(run_dir) == expected  # every step once, every number equal


def test_scontrol_requeue_mid_run_resumes_exactly(slurm_cluster: SlurmCluster, model: Path, tmp_path: Path) -> None:
    """Also pushes to a Pushgateway (when installed): after the requeue it holds the last step and the restart."""
    from tests.prom_helpers import pushed, pushgateway_if_installed

    expected = reference(tmp_path, model, 60)
    run_dir = tmp_path / "requeued"
    with pushgateway_if_installed(tmp_path / "pushgateway") as gateway:
        push = ["logging.sinks=[jsonl,prometheus]", "logging.prometheus.serve=false",
                f"logging.prometheus.push_url={gateway}"] if gateway else []
        job = submit(run_dir, model, "trainer.total_steps=60", *push)
        assert slurm_cluster.wait_for(lambda: steps_done(run_dir) >= 12, timeout=240)
        slurm_cluster.run("scontrol", "requeue", str(job))  # SIGTERM to every task at once
        records = finish(slurm_cluster, job)
        assert {r["JobState"] for r in records} == {"COMPLETED"}, records
        assert int(records[0]["Restarts"]) >= 1
        assert stable(run_dir) == expected
        report = cli("report", str(job))  # by job id: the requeued job's run dir, one restart marked
        assert report.returncode == 0, report.stderr
        attempts = re.search(r"attempts:\s+(\d+) \((\d+) requeues/restarts\); last: finished", report.stdout)
        assert attempts and int(attempts[1]) >= 2 and int(attempts[2]) >= 1, report.stdout
        assert (run_dir / "report" / "report.png").stat().st_size > 30_000
        assert_every_report_panel_has_data(run_dir)
        if gateway:
            trainer = {"job_id": str(job), "role": "trainer", "rank": "0"}
            assert pushed(gateway, "verl_hpc_step", **trainer) == rows(run_dir)[-1]["step"] == 60
            assert pushed(gateway, "verl_hpc_requeues_total", **trainer) >= 1  # from attempts.jsonl
            assert_promql_through_the_gateway(tmp_path / "prometheus", gateway, job, rows(run_dir)[-1])


def assert_every_report_panel_has_data(run_dir: Path) -> None:
    """A split run requeued under Slurm fills every panel, bandwidth and checkpoints included,
    and each panel marks the restart."""
    from verl_hpc.metrics.report import report_panels

    panels = report_panels(run_dir)
    assert [p.title for p in panels if not p.has_data] == []
    assert all(any(m.label.startswith("restart 1 ") for m in p.markers) for p in panels)


def assert_promql_through_the_gateway(state: Path, gateway: str, job: int, last: dict) -> None:
    """A real Prometheus scraping the gateway answers PromQL with the run's last step, as metrics.jsonl."""
    import time

    from tests.prom_helpers import prometheus

    where = f'job_id="{job}",role="trainer"'
    with prometheus(state, gateway=gateway) as prom:
        deadline = time.monotonic() + 60
        while not prom.query(f"verl_hpc_step{{{where}}}") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert float(prom.query(f"verl_hpc_steps_total{{{where}}}")[0]["value"][1]) == last["step"]
        for stage in ("update_actor", "wait_rollout", "step"):
            [got] = prom.query(f'verl_hpc_step_seconds{{{where},stage="{stage}"}}')
            assert float(got["value"][1]) == pytest.approx(last[f"timing_s/{stage}"], rel=1e-9), stage
        assert float(prom.query(f"verl_hpc_requeues_total{{{where}}}")[0]["value"][1]) >= 1


def test_ppo_with_every_role_apart_is_a_four_component_hetjob_that_survives_a_requeue(
        slurm_cluster: SlurmCluster, model: Path, tmp_path: Path) -> None:
    """Every role apart under Slurm: FSDP actor, FSDP critic, rollout and reward each a component."""
    config = "configs/slurm_ppo_roles_apart.yaml"
    script = cli("sbatch", config, f"model.path={model}")
    assert script.returncode == 0, script.stderr
    assert [line.strip() for line in script.stdout.splitlines()].count("#SBATCH hetjob") == 3  # four components
    expected = reference(tmp_path, model, 40, config=config)
    run_dir = tmp_path / "roles_apart"
    job = submit(run_dir, model, "trainer.total_steps=40", config=config)
    assert slurm_cluster.wait_for(lambda: steps_done(run_dir) >= 12, timeout=300)
    slurm_cluster.run("scontrol", "requeue", str(job))  # SIGTERM to every task of every component
    records = finish(slurm_cluster, job)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert len(records) == 4 and int(records[0]["Restarts"]) >= 1
    assert stable(run_dir) == expected  # the critic's shards came back from the same checkpoint
    assert {f.name for f in (run_dir / "logs").glob("env_*_rank*.json")} == {
        "env_trainer_rank0.json", "env_critic_rank1.json", "env_rollout_rank2.json", "env_reward_rank3.json"}


def test_dpo_with_an_fsdp_actor_survives_a_requeue_and_resumes_exactly(slurm_cluster: SlurmCluster, model: Path,
                                                                        tmp_path: Path) -> None:
    """DPO runs on the RL runs' runtime: the same job script, checkpoints, requeue and resume."""
    config = "configs/slurm_dpo.yaml"
    expected = reference(tmp_path, model, 40, config=config)
    assert "dpo/reward_accuracy" in expected[-1]
    run_dir = tmp_path / "dpo"
    job = submit(run_dir, model, "trainer.total_steps=40", config=config)
    assert slurm_cluster.wait_for(lambda: steps_done(run_dir) >= 12, timeout=240)
    slurm_cluster.run("scontrol", "requeue", str(job))  # SIGTERM to both tasks at once
    records = finish(slurm_cluster, job)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert int(records[0]["Restarts"]) >= 1
    assert stable(run_dir) == expected  # both FSDP shards came back; every step once, every number equal
    assert sorted(f.name for f in (run_dir / "slurm" / "logs").glob("*.out")) == ["trainer_rank0.out",
                                                                                  "trainer_rank1.out"]


SLOW_UNDER_SLURM = '''
import os, time
from verl_hpc.data.tasks.arithmetic import score as exact
def score(**sample):
    if "SLURM_JOB_ID" in os.environ:
        time.sleep(0.02)
    return exact(**sample)
'''


def test_time_limit_signal_requeues_until_done(slurm_cluster: SlurmCluster, model: Path, tmp_path: Path,
                                               cpu_hog: None) -> None:
    """`--time=2 --signal=B:USR1@60` on a busy node: each attempt stops at its deadline, in time."""
    # An attempt trains for at most ~75 s: it stops where the next step, a save and the 15 s
    # margin no longer fit before the 120 s limit, and starting takes 15-60 s on this 2-core
    # machine (the USR1 notice, 60-90 s before the limit, is the backstop). A reward that waits
    # 20 ms per sample under Slurm only makes the job need at least 32 * 128 * 0.02 = 82 s of
    # training however fast the host, so it must requeue, while a loaded host does not
    # multiply the attempts as 200 plain steps did (8 attempts, 18 minutes in CI); the
    # uninterrupted reference stays fast.
    steps = 32
    (tmp_path / "slow_reward.py").write_text(SLOW_UNDER_SLURM)
    reward = f"reward.function={tmp_path / 'slow_reward.py'}:score"
    expected = reference(tmp_path, model, steps, reward)
    run_dir = tmp_path / "timed"
    job = submit(run_dir, model, f"trainer.total_steps={steps}", "slurm.time=00:02:00", reward,
                 "slurm.signal_grace_seconds=60", "slurm.max_requeues=25")
    records = finish(slurm_cluster, job, timeout=1500)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert int(records[0]["Restarts"]) >= 1
    assert stable(run_dir) == expected
    early = [stop for stop in stops(run_dir) if stop is not None]
    assert early and all(s.time_left_s is not None and s.time_left_s > 0 for s in early), early  # before the limit
    assert {s.path for s in early} == {"deadline"}, early  # stopped by the deadline, not by the USR1 backstop


def test_max_requeues_ends_the_job_with_a_message_and_keeps_checkpoints(slurm_cluster: SlurmCluster, model: Path,
                                                                       tmp_path: Path, cpu_hog: None) -> None:
    # 2 minutes: on a busy node the four processes take 45-100 s to start (measured beside the hog
    # and other work), and the attempt must reach a step and its checkpoint to keep one; the 1
    # minute this test had was then all start-up, ended by the watchdog before any checkpoint.
    run_dir = tmp_path / "bounded"
    job = submit(run_dir, model, "trainer.total_steps=5000", "slurm.time=00:02:00",
                 "slurm.signal_grace_seconds=50", "slurm.max_requeues=0")
    records = finish(slurm_cluster, job, timeout=400)
    assert int(records[0]["Restarts"]) == 0
    assert "FAILED" in {r["JobState"] for r in records}  # stopped unfinished: not passed off as done
    logs = "".join(p.read_text() for p in (run_dir / "slurm" / "logs").glob("trainer_rank0.out"))
    assert "slurm.max_requeues=0 reached" in logs
    listing = cli("ckpt", "list", str(run_dir))
    assert listing.returncode == 0 and "committed" in listing.stdout


def test_a_slow_save_still_stops_before_the_time_limit(slurm_cluster: SlurmCluster, model: Path, tmp_path: Path,
                                                       cpu_hog: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every commit sleeps 25 s: longer than the notice's lead (`@10` comes 10-40 s before the limit),
    so stopping at the notice would be killed mid-save (TIMEOUT). The first interval save teaches
    the run how long a save takes, and the deadline stops it early enough to end in time with a
    committed checkpoint. Two processes (colocated), so that starting leaves time to learn."""
    from verl_hpc.checkpoint.manager import COMMIT_DELAY_ENV

    monkeypatch.setenv(COMMIT_DELAY_ENV, "25")  # sbatch exports the submitting environment to the job
    run_dir = tmp_path / "slow_save"
    job = submit(run_dir, model, "trainer.total_steps=5000", "slurm.time=00:02:00", "checkpoint.interval_steps=4",
                 "slurm.signal_grace_seconds=10", "slurm.max_requeues=0", config="configs/slurm_grpo_colocated.yaml")
    records = finish(slurm_cluster, job, timeout=400)
    assert {r["JobState"] for r in records} == {"FAILED"}, records  # ended by itself (no requeue left), not TIMEOUT
    [stop] = stops(run_dir)
    assert stop is not None and stop.path == "deadline" and stop.time_left_s > 0, stop
    assert stop.save_estimate_s >= 25  # the slow commits were measured, not guessed
    listing = cli("ckpt", "list", str(run_dir))
    assert listing.returncode == 0 and "committed" in listing.stdout
