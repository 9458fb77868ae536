"""Workers forked from a preloaded server behave as the launcher's own processes would."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config.loader import load_config
from verl_hpc.launch import forkserver
from verl_hpc.launch.forkserver import FORK_ENV, ForkServer, forking_wanted


def test_only_cpu_plans_of_the_runtime_worker_fork() -> None:
    worker = [sys.executable, "-m", forkserver.WORKER_MODULE]
    assert forking_wanted({"cpu"}, worker, {})
    assert not forking_wanted({"cpu", "cuda"}, worker, {})  # a GPU worker starts fresh
    assert not forking_wanted({"cpu"}, [sys.executable, "-c", "pass"], {})  # any other command too
    assert not forking_wanted({"cpu"}, worker, {FORK_ENV: "0"})


@pytest.fixture
def server() -> ForkServer:
    """A server that preloads nothing and runs a small stand-in (tests/plugins/fork_child.py) as its worker."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = ForkServer(env, module="tests.plugins.fork_child", preload=())
    yield started
    started.close()


def test_a_forked_worker_gets_its_env_log_session_and_exit_code(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "rank0.out"
    log.write_text("header\n")
    worker = server.spawn({"FORK_CHILD_EXIT": "3", "FORK_CHILD_OUT": str(tmp_path / "seen.json")}, log)
    assert worker.wait(timeout=60) == 3 and worker.returncode == 3
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["env"] == "3" and seen["sid"] == worker.pid  # its own session: the launcher's killpg reaches it
    assert log.read_text() == "header\nprinted by the child\n"  # appended after the launcher's header


def test_a_killed_worker_reports_the_signal_and_others_go_on(server: ForkServer, tmp_path: Path) -> None:
    sleeper = server.spawn({"FORK_CHILD_SLEEP": "60"}, tmp_path / "a.out")
    quick = server.spawn({"FORK_CHILD_EXIT": "0"}, tmp_path / "b.out")
    assert sleeper.poll() is None
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(timeout=60) == -signal.SIGKILL
    assert quick.wait(timeout=60) == 0


def test_a_reported_pid_already_leads_its_own_process_group(server: ForkServer, tmp_path: Path) -> None:
    """The launcher may killpg a worker the moment spawn returns: its group must exist by then."""
    workers = [server.spawn({"FORK_CHILD_SLEEP": "60"}, tmp_path / f"{i}.out") for i in range(8)]
    for worker in workers:
        assert os.getpgid(worker.pid) == worker.pid
        os.killpg(worker.pid, signal.SIGKILL)
    assert [worker.wait(timeout=60) for worker in workers] == [-signal.SIGKILL] * 8


def test_a_forked_worker_computes_with_its_own_thread_count(tmp_path: Path) -> None:
    """The server imported torch under one OMP_NUM_THREADS; each worker computes with the one it was given."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    server = ForkServer(env, module="tests.plugins.fork_child", preload=("torch",))
    try:
        worker = server.spawn({"OMP_NUM_THREADS": "2", "FORK_CHILD_OUT": str(tmp_path / "seen.json")},
                              tmp_path / "rank0.out")
        assert worker.wait(timeout=120) == 0
    finally:
        server.close()
    assert json.loads((tmp_path / "seen.json").read_text())["threads"] == 2


def test_forked_and_fresh_workers_train_the_same_numbers(tmp_path: Path, tiny_model_dir: Path) -> None:
    from verl_hpc.launch.train import train

    rows = {}
    for fork in ("1", "0"):
        os.environ[FORK_ENV] = fork
        try:
            cfg = load_config(REPO / "configs" / "quickstart_split.yaml",
                              [f"model.path={tiny_model_dir}", "trainer.total_steps=3", "logging.progress=off",
                               "trainer.save_hf_model=false"])
            run = train(cfg, tmp_path / f"fork{fork}")
        finally:
            os.environ.pop(FORK_ENV, None)
        lines = (run.run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
        rows[fork] = [{k: v for k, v in json.loads(line).items() if not k.startswith(("timing_s/", "perf/", "memory/"))}
                      for line in lines]
    assert len(rows["1"]) == 3 and rows["1"] == rows["0"]
