"""The run handle's backends without a run: exit codes, states, which log files a role or rank means."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config import dump_config, load_config
from verl_hpc.launch.handle import RunHandle
from verl_hpc.launch.local_runs import RanHere, RunDirectory, exit_state
from verl_hpc.launch.run_files import LAUNCHER_FILE, RunError, recorded_launcher
from verl_hpc.launch.slurm_job import exit_code_of
from verl_hpc.runtime.lifecycle import TrainResult


def split_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(load_config(REPO / "configs" / "quickstart_split.yaml")))
    return run_dir


@pytest.mark.parametrize(("records", "code"), [
    ([{"JobState": "COMPLETED", "ExitCode": "0:0"}] * 3, 0),
    ([{"JobState": "COMPLETED", "ExitCode": "0:0"}, {"JobState": "FAILED", "ExitCode": "7:0"}], 7),
    ([{"JobState": "CANCELLED", "ExitCode": "0:15"}], 143),
    ([{"JobState": "TIMEOUT", "ExitCode": "0:0"}], 1),
])
def test_a_slurm_jobs_exit_code_is_its_first_failing_components(records: list[dict], code: int) -> None:
    assert exit_code_of(records) == code


def test_exit_codes_read_as_states() -> None:
    assert [exit_state(c) for c in (None, 0, 1, 2, 130, 143, -9)] == \
        ["RUNNING", "COMPLETED", "FAILED", "FAILED", "STOPPED", "STOPPED", "STOPPED"]


def test_a_role_or_a_rank_selects_its_log_files(tmp_path: Path) -> None:
    run_dir = split_run(tmp_path)
    handle = RunHandle(run_dir, RanHere(run_dir, TrainResult(run_dir, 3, None, {"critic/score/mean": 0.5})))
    names = [p.name for p in handle.log_paths(role="actor")]
    assert names == ["trainer_rank0.out", "trainer_rank1.out"]
    assert [p.name for p in handle.log_paths(role="rollout")] == ["rollout_rank2.out"]
    assert [p.name for p in handle.log_paths(rank=3)] == ["reward_rank3.out"]
    with pytest.raises(RunError, match="no role or group 'critic'.*actor"):
        handle.log_paths(role="critic")
    with pytest.raises(RunError, match="rank 9 is outside the run's 4 ranks"):
        handle.log_paths(rank=9)
    (run_dir / "logs" / "rollout_rank2.out").write_text("sampled\n")
    assert handle.logs(role="rollout") == f"==> {run_dir / 'logs' / 'rollout_rank2.out'} <==\nsampled\n"
    assert {c["state"] for c in handle.status().values()} == {"COMPLETED"} and list(handle.status()) == \
        ["trainer", "rollout", "reward"]
    assert handle.result().steps == 3 and handle.wait() == 0


def test_a_run_directory_is_running_while_its_launcher_lives(tmp_path: Path) -> None:
    run_dir = split_run(tmp_path)
    assert RunDirectory(run_dir).states()["trainer"]["state"] == "UNKNOWN"  # never started
    with recorded_launcher(run_dir, ["verl-hpc", "train"]):
        handle = RunHandle(run_dir)
        assert handle.status()["trainer"]["state"] == "RUNNING" and not handle.finished()
        assert handle.job_id is not None and int(handle.job_id) > 0
    assert not (run_dir / LAUNCHER_FILE).exists() and RunHandle(run_dir).finished()
    (run_dir / LAUNCHER_FILE).write_text('{"pid": 999999999, "host": "elsewhere"}')  # a dead or foreign launcher
    assert RunHandle(run_dir).status()["trainer"]["state"] == "UNKNOWN"
