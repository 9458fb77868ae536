"""LocalLauncher with real processes: env contract, failure reports, signals, no orphans.

Workers are a stdlib-only script (fast to start) driven by a JSON spec: what each rank
does (exit 0, sleep, exit 3, SIGKILL itself), which ranks fork a `sleep 300` grandchild
and which ignore SIGTERM. Every pid is written to a file so the test can check, with
psutil, that nothing survives; a fixture kills leftovers so a failing test leaks nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from verl_hpc.config.placement import ProcessPlan, plan_processes
from verl_hpc.config.resources import ResourceConfig, RoleResources
from verl_hpc.launch.local import (
    EXIT_TIME_LIMIT,
    LaunchTimeout,
    LocalLauncher,
    WorkerFailure,
    describe_exit,
)
from verl_hpc.launch.log_tail import crash_excerpt
from verl_hpc.launch.worker_env import worker_env
from verl_hpc.runtime.process.endtime import EXIT_AT_DEADLINE

ENV_KEYS = ("VERL_HPC_RANK", "VERL_HPC_WORLD_SIZE", "VERL_HPC_LOCAL_RANK", "VERL_HPC_GROUP",
            "VERL_HPC_GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "VERL_HPC_RUN_DIR", "CUDA_VISIBLE_DEVICES",
            "VERL_HPC_END_TIME")

WORKER = r'''
import json, os, signal, subprocess, sys, time

out, spec = sys.argv[1], json.loads(sys.argv[2])
rank = int(os.environ["VERL_HPC_RANK"])
world = int(os.environ["VERL_HPC_WORLD_SIZE"])


def record(name, value):
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(value)
    os.replace(tmp, os.path.join(out, name))


def wait_for_everyone():
    deadline = time.time() + 10
    while time.time() < deadline:
        if all(os.path.exists(os.path.join(out, f"pid_{r}")) for r in range(world)):
            return
        time.sleep(0.02)


record(f"env_{rank}.json", json.dumps({k: os.environ.get(k) for k in KEYS}))
print(f"hello from rank {rank} {spec.get('tag', '')}", flush=True)
if rank in spec.get("grandchild", []):
    record(f"grandchild_{rank}", str(subprocess.Popen(["sleep", "300"]).pid))
if rank in spec.get("setsid_grandchild", []):  # escapes the worker's process group
    record(f"grandchild_setsid_{rank}", str(subprocess.Popen(["sleep", "300"], start_new_session=True).pid))
if rank in spec.get("ignore_term", []):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record(f"pid_{rank}", str(os.getpid()))
action = spec.get("actions", {}).get(str(rank), spec.get("default", "exit0"))
if action == "sleep":
    time.sleep(60)
elif action == "kill":
    wait_for_everyone()
    print("about to die", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
elif action == "abort":  # a native crash: the C++ runtime's words, then faulthandler's dump of every thread
    import faulthandler, threading
    faulthandler.enable(all_threads=True)
    for _ in range(3):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    wait_for_everyone()
    print("terminate called after throwing an instance of 'gloo::EnforceNotMet'", file=sys.stderr, flush=True)
    print("  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4", file=sys.stderr,
          flush=True)
    os.abort()
elif action == "exit3":
    wait_for_everyone()
    print("exiting with 3", flush=True)
    sys.exit(3)
elif action == "deadline":  # the leader stopped at its deadline: EXIT_AT_DEADLINE, after the others left
    wait_for_everyone()
    time.sleep(0.5)
    sys.exit(75)
'''.replace("KEYS", repr(ENV_KEYS))

DRIVER = r'''
import json, sys
from pathlib import Path
from verl_hpc.config.placement import plan_processes
from verl_hpc.config.resources import ResourceConfig, RoleResources
from verl_hpc.launch.local import LocalLauncher

args = json.loads(sys.argv[1])
resources = ResourceConfig(actor=RoleResources(device_ids=[0, 1]), rollout=RoleResources(device_ids=[0]),
                           placement="split")
plan = plan_processes(resources, needs_critic=False, needs_ref=False, reward_is_model=False)
launcher = LocalLauncher(plan, Path(args["run_dir"]), args["command"], grace_seconds=args["grace"])
sys.exit(launcher.run())
'''


def split_plan() -> ProcessPlan:
    resources = ResourceConfig(actor=RoleResources(device_ids=[0, 1]), rollout=RoleResources(device_ids=[0]),
                               placement="split")
    return plan_processes(resources, needs_critic=False, needs_ref=False, reward_is_model=False)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def recorded_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("pid_*")) + sorted(out.glob("grandchild_*"))
            if not p.name.endswith(".tmp")]


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    """Where workers record env and pids; leftovers of a failed test are killed afterwards."""
    directory = tmp_path / "out"
    directory.mkdir()
    yield directory
    for pid in recorded_pids(directory):
        try:
            proc = psutil.Process(pid)
            if str(tmp_path) in " ".join(proc.cmdline()) or proc.name() == "sleep":
                proc.kill()
        except psutil.Error:
            pass


def worker_command(tmp_path: Path, out: Path, spec: dict) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return [sys.executable, str(script), str(out), json.dumps(spec)]


def test_env_logs_and_success(tmp_path: Path, out: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = LocalLauncher(split_plan(), run_dir, worker_command(tmp_path, out, {"tag": "ok"}))
    assert launcher.run() == 0
    envs = [json.loads((out / f"env_{r}.json").read_text()) for r in range(3)]
    assert [e["VERL_HPC_RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["VERL_HPC_LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["VERL_HPC_WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["VERL_HPC_GROUP"] for e in envs] == ["trainer", "trainer", "rollout"]
    assert [e["VERL_HPC_GROUP_RANK"] for e in envs] == ["0", "1", "0"]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert {e["VERL_HPC_RUN_DIR"] for e in envs} == {str(run_dir)}
    for rank, group in enumerate(["trainer", "trainer", "rollout"]):
        log = run_dir / "logs" / f"{group}_rank{rank}.out"
        assert f"hello from rank {rank} ok" in log.read_text()
    assert not any(alive(pid) for pid in launcher.pids.values())


def test_ranks_share_the_cores_unless_the_environment_says_otherwise() -> None:
    plan = split_plan()  # 3 ranks
    shared = str(max(1, (os.cpu_count() or 1) // 3))
    assert {worker_env(plan, r, 1234, Path("/run"), {})["OMP_NUM_THREADS"] for r in range(3)} == {shared}
    assert worker_env(plan, 0, 1234, Path("/run"), {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_worker_env_cuda_devices() -> None:
    resources = ResourceConfig(actor=RoleResources(device_type="cuda", device_ids=[2, 3]),
                               rollout=RoleResources(device_type="cuda", device_ids=[1]), placement="split")
    plan = plan_processes(resources, needs_critic=False, needs_ref=False, reward_is_model=False)
    envs = [worker_env(plan, r, 1234, Path("/run"), {}) for r in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3", "1"]
    mapped = [worker_env(plan, r, 1234, Path("/run"), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) for r in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in mapped] == ["6", "7", "5"]
    with pytest.raises(ValueError, match="not among"):
        worker_env(plan, 1, 1234, Path("/run"), {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "CUDA_VISIBLE_DEVICES" not in worker_env(split_plan(), 0, 1, Path("/run"), {})
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"


def test_sigkilled_worker_fails_fast_without_orphans(tmp_path: Path, out: Path) -> None:
    spec = {"default": "sleep", "actions": {"2": "kill"}, "grandchild": [0, 2], "setsid_grandchild": [1]}
    launcher = LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, spec), grace_seconds=5)
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        launcher.run()
    assert time.monotonic() - start < 15  # the others sleep 60 s
    failure = info.value
    assert (failure.group, failure.rank, failure.signal_name) == ("rollout", 2, "SIGKILL")
    assert "rollout" in str(failure) and "rank 2" in str(failure) and "killed by SIGKILL" in str(failure)
    assert "about to die" in failure.last_lines[-1] and "about to die" in str(failure)
    assert failure.log_path == tmp_path / "run" / "logs" / "rollout_rank2.out"
    pids = recorded_pids(out)
    assert len(pids) == 6  # three workers, two grandchildren in their groups, one in its own session
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 2), [p for p in pids if alive(p)]


def test_exit_code_is_reported(tmp_path: Path, out: Path) -> None:
    spec = {"default": "sleep", "actions": {"1": "exit3"}}
    launcher = LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, spec), grace_seconds=5)
    with pytest.raises(WorkerFailure, match="exit code 3") as info:
        launcher.run()
    assert (info.value.group, info.value.rank, info.value.returncode) == ("trainer", 1, 3)
    assert info.value.signal_name is None and "exiting with 3" in str(info.value)
    assert not any(alive(pid) for pid in recorded_pids(out))


def test_a_leader_stopped_at_its_deadline_is_not_a_failure(tmp_path: Path, out: Path) -> None:
    """`verl-hpc train --time-limit`: the leader exits EXIT_AT_DEADLINE after its checkpoint, the others 0."""
    spec = {"default": "exit0", "actions": {"0": "deadline"}}
    launcher = LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, spec), grace_seconds=5)
    assert launcher.run() == EXIT_AT_DEADLINE


def test_workers_still_running_at_the_time_limit_are_stopped(tmp_path: Path, out: Path) -> None:
    """As Slurm at a job's limit: SIGTERM, SIGKILL after the grace period (KillWait), nothing left."""
    end = time.time() + 3
    spec = {"default": "sleep", "grandchild": [1], "ignore_term": [2]}
    launcher = LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, spec), grace_seconds=1,
                             end_time=end)
    assert launcher.run() == EXIT_TIME_LIMIT
    assert end <= time.time() < end + 15  # the workers sleep 60 s
    envs = [json.loads((out / f"env_{r}.json").read_text()) for r in range(3)]
    assert all(abs(float(e["VERL_HPC_END_TIME"]) - end) < 1e-3 for e in envs)  # they stop before it
    assert wait_until(lambda: not any(alive(pid) for pid in recorded_pids(out)), 2)


def test_a_native_crash_is_reported_by_its_cause_not_by_the_last_thread_dumped(tmp_path: Path, out: Path) -> None:
    spec = {"default": "sleep", "actions": {"1": "abort"}}
    launcher = LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, spec), grace_seconds=5)
    with pytest.raises(WorkerFailure, match="killed by SIGABRT") as info:
        launcher.run()
    lines = info.value.last_lines
    fatal = next(i for i, line in enumerate(lines) if line.startswith("Fatal Python error: Aborted"))
    assert "gloo::EnforceNotMet" in lines[fatal - 2] and "op.preamble.length" in lines[fatal - 1], lines
    assert lines[fatal + 1].startswith("Current thread"), lines
    assert not any(line.startswith("Thread 0x") for line in lines), lines  # the sleeping threads are left out
    assert any("worker.py" in line for line in lines)


def test_crash_excerpt_is_the_tail_when_nothing_crashed() -> None:
    log = [f"line {i}" for i in range(30)]
    assert crash_excerpt(log, 5) == log[-5:]


def test_timeout_kills_everything(tmp_path: Path, out: Path) -> None:
    spec = {"default": "sleep", "grandchild": [1]}
    launcher = LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, spec),
                             grace_seconds=2, timeout_seconds=1.5)
    with pytest.raises(LaunchTimeout, match="timed out") as info:
        launcher.run()
    assert info.value.running == [0, 1, 2] and info.value.rank == 0
    assert wait_until(lambda: not any(alive(pid) for pid in recorded_pids(out)), 2)


def start_driver(tmp_path: Path, out: Path, spec: dict, grace: float) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    args = {"run_dir": str(tmp_path / "run"), "command": worker_command(tmp_path, out, spec), "grace": grace}
    proc = subprocess.Popen([sys.executable, str(driver), json.dumps(args)])
    expected = 3 + len(spec.get("grandchild", []))
    assert wait_until(lambda: len(recorded_pids(out)) == expected, 10), "workers did not start"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_world(tmp_path: Path, out: Path, sig: signal.Signals) -> None:
    # Rank 1 ignores SIGTERM, so it must be SIGKILLed once the 1 s grace period ends.
    spec = {"default": "sleep", "grandchild": [0], "ignore_term": [1]}
    driver = start_driver(tmp_path, out, spec, grace=1.0)
    pids = recorded_pids(out)
    driver.send_signal(sig)
    assert driver.wait(timeout=10) == 128 + sig
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 2), [p for p in pids if alive(p)]


def test_sigkilled_launcher_takes_workers_along(tmp_path: Path, out: Path) -> None:
    driver = start_driver(tmp_path, out, {"default": "sleep"}, grace=5.0)
    pids = recorded_pids(out)
    driver.kill()
    driver.wait(timeout=5)
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 5), [p for p in pids if alive(p)]


def test_logs_append_across_runs(tmp_path: Path, out: Path) -> None:
    run_dir = tmp_path / "run"
    assert LocalLauncher(split_plan(), run_dir, worker_command(tmp_path, out, {"tag": "first"})).run() == 0
    assert LocalLauncher(split_plan(), run_dir, worker_command(tmp_path, out, {"tag": "second"})).run() == 0
    text = (run_dir / "logs" / "rollout_rank2.out").read_text()
    assert text.index("hello from rank 2 first") < text.index("hello from rank 2 second")
    assert text.count("==== verl-hpc launch") == 2


def test_signal_handlers_restored(tmp_path: Path, out: Path) -> None:
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    LocalLauncher(split_plan(), tmp_path / "run", worker_command(tmp_path, out, {})).run()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
