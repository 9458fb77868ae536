"""The env component's workers (verl_hpc/roles/env/remote.py) without Slurm: each task's supervisor is
started here as Slurm would start it (SLURM_PROCID, SLURM_JOB_ID, SLURM_RESTART_COUNT set), and the
rollout's runner reaches the workers by the run directory, over TCP, with the run's token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.roles.test_env import kill_a_worker_mid_episode
from verl_hpc.roles.env import EnvFailure, EnvReply
from verl_hpc.roles.env.remote import EnvHome, RemoteWorker, attempt_dir, remote_starter
from verl_hpc.roles.env.workers import ProcessEnvRunner
from verl_hpc.transport.secret import create_run_secret

PID_ENV = f"{REPO / 'tests' / 'plugins' / 'agent_envs.py'}:PidEnv"


def _run_dir(tmp_path: Path, environment: dict | None = None) -> Path:
    config = yaml.safe_load((REPO / "configs" / "env_box.yaml").read_text())
    config["rollout"]["multi_turn"]["environment"].update(environment or {"id": PID_ENV, "kwargs": {}})
    config["resources"]["env"] = {"num_workers": 2}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    create_run_secret(run_dir)
    return run_dir


@pytest.fixture
def component(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, list[subprocess.Popen]]]:
    """Two env tasks of job 77's first attempt, as `srun --het-group=N` starts them (a test's
    `environment` mark replaces the config's environment)."""
    mark = request.node.get_closest_marker("environment")
    run_dir = _run_dir(tmp_path, mark.args[0] if mark else None)
    tasks = []
    for index in range(2):
        env = {**os.environ, "SLURM_PROCID": str(index), "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0",
               "PYTHONPATH": str(REPO)}
        tasks.append(subprocess.Popen([sys.executable, "-m", "verl_hpc.roles.env.remote", str(run_dir)], env=env))
    yield run_dir, tasks
    for task in tasks:
        task.send_signal(signal.SIGINT)
    for task in tasks:
        assert task.wait(timeout=30) == 0  # a stopped supervisor stops its worker and leaves cleanly


def _home(run_dir: Path, restart: int = 0, wait_s: float = 60.0) -> EnvHome:
    token = (run_dir / "secrets" / "flight_token").read_text()
    return EnvHome(attempt_dir(run_dir, "77", restart), 2, token, wait_s)


def test_episodes_reach_the_component_by_the_run_directory_and_survive_a_killed_worker(component) -> None:
    run_dir, _ = component
    runner = ProcessEnvRunner(remote_starter(_home(run_dir), reconnect_s=30.0), 2, timeout=30.0)
    try:
        firsts = runner.reset_all([(f"e{i}", i, {}) for i in range(4)])
        pids = {int(f.reply.text) for f in firsts}
        assert len(pids) == 2 and os.getpid() not in pids  # both workers, episodes spread over them
        assert all(runner.submit(f"e{i}", "7").result(timeout=30).reply == EnvReply("answer 2", 1.0, False)
                   for i in range(4))
        for i in range(4):
            runner.finish(f"e{i}")
        again = kill_a_worker_mid_episode(runner, "closed its connection")  # its supervisor restarts it
        assert len({a.reply.text for a in again}) == 2
    finally:
        runner.close()


@pytest.mark.environment({"source": "textarena", "id": "TicTacToe-v0", "kwargs": {}, "players": 2})
def test_self_play_matches_run_on_the_component(component) -> None:
    pytest.importorskip("textarena")
    from verl_hpc.roles.env.runner import parked

    run_dir, _ = component
    runner = ProcessEnvRunner(remote_starter(_home(run_dir), reconnect_s=30.0), 2, timeout=30.0, players=2)
    try:
        seats = [f"episode-1-0-{i}" for i in range(4)]
        firsts = runner.reset_all([(name, 3, {}) for name in seats])
        assert "Player 0" in firsts[0].reply.text and parked(firsts[1].later)
        moved = runner.submit(seats[0], "[4]").result(timeout=30)
        assert parked(moved.later)  # seat 1 moves next, and has now seen seat 0's move:
        assert "Current Board" in firsts[1].later.result(timeout=30).reply.text
        runner.left(seats[2])  # the other match's seat 0 left: its opponent's game ends unrewarded
        assert firsts[3].later.result(timeout=30).reply.done
    finally:
        runner.close()


def test_sigterm_leaves_the_workers_serving_the_step_in_progress(component) -> None:
    """Slurm's SIGTERM (a requeue, the time limit) reaches every task at once, while the trainer still
    finishes its step: the workers must answer until the job script ends their step."""
    run_dir, tasks = component
    runner = ProcessEnvRunner(remote_starter(_home(run_dir), reconnect_s=5.0), 2, timeout=30.0)
    try:
        firsts = runner.reset_all([(f"e{i}", i, {}) for i in range(2)])
        for task in tasks:
            task.send_signal(signal.SIGTERM)
        for first in firsts:
            os.kill(int(first.reply.text), signal.SIGTERM)  # what slurmstepd sends each process of a task
        time.sleep(1.0)
        steps = [runner.submit(f"e{i}", "7").result(timeout=30) for i in range(2)]
        assert all(s.reply == EnvReply("answer 2", 1.0, False) for s in steps)
        assert all(task.poll() is None for task in tasks)
    finally:
        runner.close()


def test_a_wrong_token_or_another_attempt_reaches_no_worker(component) -> None:
    run_dir, _ = component
    RemoteWorker(0, _home(run_dir)).stop()  # the component is up
    wrong = EnvHome(attempt_dir(run_dir, "77", 0), 2, "00" * 32, 5.0)
    with pytest.raises(EnvFailure, match="refused the run's token"):
        RemoteWorker(0, wrong)
    with pytest.raises(EnvFailure, match="unreachable within 1 s"):  # a requeued job never reaches these
        RemoteWorker(0, _home(run_dir, restart=1, wait_s=1.0))


def test_the_attempt_is_the_tasks_slurm_job_and_restart() -> None:
    env = {"SLURM_JOB_ID": "12", "SLURM_HET_JOB_ID": "10", "SLURM_RESTART_COUNT": "3"}
    home = EnvHome.of_attempt("/r", 4, "ab", 9.0, env)
    assert home.directory == Path("/r/env_workers/10.3") and home.num_workers == 4  # one id over all components
    assert EnvHome.of_attempt("/r", 1, "ab", 9.0, {}).directory == Path("/r/env_workers/0.0")


def test_a_worker_that_keeps_dying_is_given_up(tmp_path: Path) -> None:
    from verl_hpc.roles.env import remote

    started = time.monotonic()
    code = remote.supervise(tmp_path, 0, [sys.executable, "-c", "raise SystemExit(5)"], dict(os.environ))
    assert code == 1 and time.monotonic() - started < 30


class _FakeLink:
    """A worker link that answers at once, until it is marked dead."""

    def __init__(self, index: int):
        import concurrent.futures as cf

        self.index, self.dead, self._cf = index, False, cf

    @property
    def alive(self) -> bool:
        return not self.dead

    def request(self, request_id: int, op: str, episode: str, payload: object):
        future = self._cf.Future()
        future.set_result(("ok", (f"worker {self.index}", 0.0, False)) if op != "close" else ("ok", None))
        return future

    def expect(self, episode: str):
        return self._cf.Future()

    def forget(self, episode: str) -> None:
        pass

    def stop(self) -> None:
        self.dead = True


def test_a_worker_that_cannot_come_back_is_skipped_not_waited_for_at_every_episode() -> None:
    starts: list[int] = []

    def start(index: int) -> _FakeLink:
        starts.append(index)
        if len(starts) > 2:  # after the first two: worker 1's node is gone
            raise EnvFailure(f"environment worker {index} unreachable")
        return _FakeLink(index)

    runner = ProcessEnvRunner(start, 2, timeout=5.0)
    try:
        runner.workers[1].dead = True
        outcomes = runner.reset_all([(f"e{i}", i, {}) for i in range(6)])
        assert [o.reply.text for o in outcomes] == ["worker 0"] * 6  # all on the worker still alive
        assert starts == [0, 1, 1]  # one try to start worker 1 again, then none until RETRY_AFTER_S
        runner.workers[0].dead = True
        lost = runner.reset_all([("f", 0, {})])[0]
        assert lost.reply is None and "unreachable" in lost.error  # none left: the episode fails, counted
    finally:
        runner.close()


def test_episodes_already_placed_do_not_wait_for_a_worker_being_started_again() -> None:
    """A dead worker is started again while a new episode is placed (a remote one may take seconds to
    reach); the steps and ends of episodes already placed on another worker go on meanwhile."""
    import threading

    release, runner_ready = threading.Event(), threading.Event()

    def start(index: int) -> _FakeLink:
        if index == 1 and runner_ready.is_set():  # the restart, not the first start
            assert release.wait(30), "never released"
        return _FakeLink(index)

    runner = ProcessEnvRunner(start, 2, timeout=5.0)
    runner_ready.set()
    try:
        assert runner.reset_all([("placed", 0, {})])[0].reply.text == "worker 0"
        runner.workers[1].dead = True
        placing = threading.Thread(target=runner.reset_all, args=([("new", 1, {})],))
        placing.start()  # its turn is worker 1: started again, blocked until released
        time.sleep(0.2)
        step = runner.submit("placed", "go").result(timeout=2)  # not behind the restart
        assert step.reply.text == "worker 0"
        runner.finish("placed")
        assert placing.is_alive()  # the restart was still waiting all along
        release.set()
        placing.join(10)
        assert runner.restarts == 1 and runner.workers[1].alive
    finally:
        release.set()
        runner.close()
