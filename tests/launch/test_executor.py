"""One launch interface: executors render what they would start, start it, and answer with one `RunHandle`.

The local executor's runs are real: a one-process run in the foreground (its handle, then a
rerun of the finished run), and one in the background stopped from another shell with
`verl-hpc cancel RUN_DIR`, as a user would. The Slurm executor's submissions run on the local
cluster in tests/slurm/test_submit.py; here its dry run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli
from verl_hpc.cli.main import main
from verl_hpc.config import ConfigError, load_config
from verl_hpc.launch.executor import LocalExecutor, SlurmExecutor, render_local
from verl_hpc.launch.handle import RunHandle
from verl_hpc.launch.run_files import RunError
from verl_hpc.launch.sbatch import render_sbatch
from verl_hpc.runtime.state.run_dir import ALLOW_ENV

QUICKSTART = REPO / "configs" / "quickstart.yaml"
SMALL = ["trainer.batch_size=16", "algorithm.sampling.max_new_tokens=2", "logging.progress=lines"]


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_local_render_shows_each_worker_with_its_variables(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "quickstart_split.yaml")
    text = render_local(cfg, tmp_path / "run", "/opt/py/bin/python", None, {})
    workers = [line for line in text.splitlines() if not line.startswith("#")]
    assert [w.split("VERL_HPC_GROUP=")[1].split()[0] for w in workers] == ["trainer", "trainer", "rollout", "reward"]
    for rank, line in enumerate(workers):
        assert f"VERL_HPC_RANK={rank} " in line and "VERL_HPC_WORLD_SIZE=4" in line
        assert line.split(" >> ")[0].endswith("/opt/py/bin/python -m verl_hpc.runtime.worker")
        assert line.endswith(f"_rank{rank}.out 2>&1") and str(tmp_path / "run" / "logs") in line
    cuda = load_config(REPO / "configs" / "quickstart_colocated.yaml",
                       ["resources.actor={device_type: cuda, device_ids: [0, 1], strategy: fsdp}",
                        "resources.rollout={device_type: cuda, device_ids: [0, 1], strategy: hf}"])
    mapped = render_local(cuda, tmp_path / "run", "python", None, {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert [line.split("CUDA_VISIBLE_DEVICES=")[1].split()[0] for line in mapped.splitlines()[2:]] == ["4", "5"]
    one = render_local(load_config(QUICKSTART), tmp_path / "run", "python", ["python", "-m", "verl_hpc"], {})
    assert "one process (actor, rollout, reward" in one and "in the background: python -m verl_hpc" in one


def test_train_dry_run_prints_the_render_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out, err = cli("train", str(REPO / "configs" / "quickstart_colocated.yaml"), "--run-dir", str(run_dir),
                         f"model.path={tmp_path / 'model'}", "--dry-run")
    assert code == 0, err
    expected = LocalExecutor().render(REPO / "configs" / "quickstart_colocated.yaml", run_dir,
                                      [f"model.path={tmp_path / 'model'}"])
    assert out == expected and out.count("-m verl_hpc.runtime.worker") == 2
    assert sorted(tmp_path.iterdir()) == []  # neither the run directory nor the model


def test_slurm_executor_render_is_the_script_submit_sends(tmp_path: Path) -> None:
    config = REPO / "configs" / "slurm_local.yaml"
    text = SlurmExecutor("/opt/py/bin/python").render(config, tmp_path / "run", ["trainer.total_steps=5"])
    cfg = load_config(config, ["trainer.total_steps=5"])
    assert text == render_sbatch(cfg, tmp_path / "run", tmp_path / "run" / "slurm", "/opt/py/bin/python")
    code, out, _ = cli("sbatch", str(config), "--run-dir", str(tmp_path / "run"), "--python", "/opt/py/bin/python",
                       "trainer.total_steps=5")
    assert code == 0 and out == text
    assert sorted(tmp_path.iterdir()) == []


def test_the_package_names_are_the_executors_and_the_handle() -> None:
    import verl_hpc
    from verl_hpc.launch import executor

    assert verl_hpc.submit is executor.submit and verl_hpc.SlurmExecutor is SlurmExecutor
    assert verl_hpc.RunHandle is RunHandle and verl_hpc.SlurmJob is RunHandle  # the handle's former name
    assert RunHandle.lookup.__func__ is RunHandle.attach.__func__


def test_attaching_to_nothing_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="not a Slurm job id"):
        RunHandle(tmp_path / "absent")
    for command in ("status", "logs", "cancel"):
        code, _, err = cli(command, str(tmp_path / "absent"))
        assert code == 2 and err.count("\n") == 1 and "nor a run directory" in err, err


@pytest.mark.slow
def test_a_foreground_run_its_handle_and_a_rerun_of_the_finished_run(tmp_path: Path, tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    overrides = [f"model.path={tiny_model_dir}", *SMALL, "trainer.total_steps=2", "trainer.save_hf_model=false"]
    handle = LocalExecutor().submit(QUICKSTART, run_dir, overrides)
    assert handle.kind == "local" and handle.finished() and handle.wait() == 0
    assert {c["state"] for c in handle.status().values()} == {"COMPLETED"}
    result = handle.result()
    assert result.steps == 2 and [r["step"] for r in handle.metrics()] == [1, 2] and handle.last_step() == 2
    assert "trainer_rank0.log <==" in handle.logs() and "training grpo for 2 steps" in handle.logs(rank=0)

    attached = RunHandle(run_dir)  # another shell: the run directory alone
    assert attached.status()["trainer"]["state"] == "COMPLETED" and attached.wait() == 0
    assert attached.result().last_metrics["critic/score/mean"] == result.last_metrics["critic/score/mean"]
    with pytest.raises(RunError, match="nothing to cancel"):
        attached.cancel()

    # Finished comes from the run state: no hf_model/ here, yet the same command is refused...
    attempts = (run_dir / "attempts.jsonl").read_text()
    with pytest.raises(ConfigError, match="finished at step 2"):
        LocalExecutor().submit(QUICKSTART, run_dir, overrides)
    # ...and an operational change is recorded without loading or training anything.
    again = LocalExecutor().submit(QUICKSTART, run_dir, [*overrides, "logging.log_every=2"]).result()
    assert again.steps == 2 and again.last_metrics["critic/score/mean"] == result.last_metrics["critic/score/mean"]
    assert (run_dir / "attempts.jsonl").read_text() == attempts  # no attempt, no made-up lost_s
    (entry,) = yaml.safe_load((run_dir / "config_history.yaml").read_text())
    assert list(entry["changed"]) == ["logging.log_every"]
    proc = run_cli("train", str(QUICKSTART), "--run-dir", str(run_dir), *overrides, "logging.log_every=2")
    assert proc.returncode == 2 and "already holds a run that finished at step 2" in proc.stderr, proc.stderr[-2000:]
    assert "final score nan" not in proc.stderr + proc.stdout

    # Trained further, the resumed run says what is left, in words.
    monkeypatch.setenv(ALLOW_ENV, "1")
    more = LocalExecutor().submit(QUICKSTART, run_dir, [*overrides, "logging.log_every=2", "trainer.total_steps=3"])
    assert more.result().steps == 3
    messages = [json.loads(line)["msg"] for line in (run_dir / "logs" / "trainer_rank0.log").read_text().splitlines()]
    assert f"training grpo for 1 more step (3-3 of 3) in {run_dir}" in messages
    resumed = [m for m in messages if m.startswith("resumed from")]
    assert resumed and resumed[-1].endswith("(saved by 1 trainer process)") and "{" not in resumed[-1], resumed


def _path_without_this_venv() -> str:
    here = Path(sys.executable).parent.resolve()
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != here)


@pytest.mark.slow
def test_a_background_run_is_stopped_from_another_shell(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`verl-hpc status/cancel RUN_DIR` find the live launcher; the stop message's command works as typed."""
    run_dir = tmp_path / "run"
    executor = LocalExecutor(background=True, env={"PATH": _path_without_this_venv(), "TOKENIZERS_PARALLELISM": "false"})
    handle = executor.submit(QUICKSTART, run_dir, [f"model.path={tiny_model_dir}", *SMALL,
                                                   "trainer.total_steps=1000", "checkpoint.interval_steps=1"])
    try:
        _stop_from_another_shell(handle, run_dir)
    finally:
        handle.cancel()  # nothing when it has stopped; else no run is left behind by a failed check
        handle.wait(timeout=120)


def _stop_from_another_shell(handle: RunHandle, run_dir: Path) -> None:
    deadline = time.monotonic() + 300
    while handle.last_step() is None and time.monotonic() < deadline and not handle.finished():
        time.sleep(0.5)
    assert handle.status()["trainer"]["state"] == "RUNNING", handle.logs()[-3000:]
    status = run_cli("status", str(run_dir))
    assert status.returncode == 0 and f"state: RUNNING (launcher pid {handle.job_id})" in status.stdout, status.stdout
    cancelled = run_cli("cancel", str(run_dir))
    assert cancelled.returncode == 0 and "SIGTERM to its launcher" in cancelled.stdout, cancelled.stderr
    assert handle.wait(timeout=300) == 143
    assert handle.status()["trainer"]["state"] == "STOPPED"
    result = handle.result()
    assert result.stopped_by == "SIGTERM" and result.steps >= 1
    assert (run_dir / "checkpoints" / f"step_{result.steps:08d}" / "manifest.json").is_file()
    launcher_log = (run_dir / "logs" / "launcher.out").read_text()
    # started as `python -m verl_hpc` with no verl-hpc on PATH: the resume command says so
    assert f"To resume: {sys.executable} -m verl_hpc train {QUICKSTART}" in launcher_log, launcher_log[-2000:]
    assert RunHandle(run_dir).status()["trainer"]["state"] == "STOPPED"  # from its attempts, later
    assert "launcher.out <==" in run_cli("logs", str(run_dir)).stdout
