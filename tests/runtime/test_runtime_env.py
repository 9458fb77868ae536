"""JobEnvironment from each launcher's variables, hostlists, ports and the debug file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from verl_hpc.runtime.process.env import JobEnvironment, port_from_job_id
from verl_hpc.runtime.process.hostlist import expand_hostlist, hostnames, parse_tasks_per_node


@pytest.fixture(autouse=True)
def _no_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests must not depend on whether this machine has Slurm: hide any real scontrol."""
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def slurm_env(**extra: str) -> dict[str, str]:
    base = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
            "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "0"}
    return {**base, **extra}


def hetjob_env(procid: int, alias: str = "HET") -> dict[str, str]:
    size_name = "SLURM_HET_SIZE" if alias == "HET" else "SLURM_PACK_SIZE"
    env = {size_name: "3", "SLURM_PROCID": str(procid), "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu7", f"SLURM_JOB_NODELIST_{alias}_GROUP_0": "node[3-4]",
           f"SLURM_JOB_NODELIST_{alias}_GROUP_1": "gpu7", f"SLURM_JOB_NODELIST_{alias}_GROUP_2": "gpu9"}
    for k, n in enumerate((2, 1, 1)):
        env[f"SLURM_NTASKS_{alias}_GROUP_{k}"] = str(n)
    return env


def test_local_launcher_takes_precedence_over_slurm() -> None:
    env = JobEnvironment.from_env({"VERL_HPC_RANK": "2", "VERL_HPC_WORLD_SIZE": "3", "VERL_HPC_LOCAL_RANK": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "31000", **slurm_env()})
    assert (env.scheduler, env.rank, env.world_size, env.local_rank) == ("local", 2, 3, 2)
    assert (env.master_addr, env.master_port, env.local_world_size) == ("127.0.0.1", 31000, 3)
    assert env.het_component() is None


def test_torchrun() -> None:
    env = JobEnvironment.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                   "MASTER_ADDR": "host-a", "MASTER_PORT": "29400",
                                   "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "abc"})
    assert (env.scheduler, env.rank, env.world_size, env.local_rank, env.local_world_size) == \
        ("torchrun", 5, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.restart_count, env.job_id) == ("host-a", 29400, 2, "abc")
    assert env.to_env() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                            "MASTER_ADDR": "host-a", "MASTER_PORT": "29400"}


def test_plain_slurm() -> None:
    env = JobEnvironment.from_env(slurm_env(SLURM_RESTART_COUNT="3"))
    assert (env.scheduler, env.rank, env.world_size, env.local_rank, env.local_world_size) == \
        ("slurm", 1, 4, 1, 2)
    assert env.master_addr == "node01"
    assert env.master_port == 29500 + 123456 % 20000
    assert (env.job_id, env.restart_count) == ("123456", 3)
    assert env.het_component() is None


def test_slurm_master_port_override_and_uneven_tasks_per_node() -> None:
    env = JobEnvironment.from_env(slurm_env(MASTER_PORT="40001", MASTER_ADDR="login1",
                                            SLURM_TASKS_PER_NODE="3,1(x2)", SLURM_NODEID="2",
                                            SLURM_LOCALID="0"))
    assert (env.master_port, env.master_addr, env.local_world_size) == (40001, "login1", 1)
    assert JobEnvironment.from_env(slurm_env(SLURM_NTASKS_PER_NODE="4")).local_world_size == 4


@pytest.mark.parametrize("alias", ["HET", "PACK"])
def test_hetjob_three_components(alias: str) -> None:
    env = JobEnvironment.from_env(hetjob_env(procid=3, alias=alias))
    assert (env.rank, env.world_size) == (3, 4)
    assert env.het_group_sizes == (2, 1, 1)
    assert env.het_component() == (2, 0)
    assert env.master_addr == "node3"  # component 0's first node, not this task's own node
    assert JobEnvironment.from_env(hetjob_env(procid=1, alias=alias)).het_component() == (0, 1)
    assert JobEnvironment.from_env(hetjob_env(procid=2, alias=alias)).het_component() == (1, 0)


def measured_het_step(procid: int, nodeid: int, localid: int) -> dict[str, str]:
    """What `srun --het-group=0-2` gave a task on Slurm 22.05.8 (components of 2, 1, 1 tasks)."""
    env = {**hetjob_env(procid), "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "xnode[1-3]", "SLURM_JOB_NODELIST": "xnode[1-3]",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "xnode1", "SLURM_STEP_TASKS_PER_NODE": "2,1(x2)",
           "SLURM_TASKS_PER_NODE": "2,1(x2)", "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2",
           "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1", "SLURM_TASKS_PER_NODE_HET_GROUP_2": "1",
           "SLURM_NODEID": str(nodeid), "SLURM_LOCALID": str(localid)}
    return env


@pytest.mark.parametrize(("procid", "nodeid", "localid", "component", "local_world"), [
    (0, 0, 0, (0, 0), 2), (1, 0, 1, (0, 1), 2), (2, 1, 0, (1, 0), 1), (3, 2, 0, (2, 0), 1)])
def test_measured_het_step(procid: int, nodeid: int, localid: int, component: tuple[int, int],
                           local_world: int) -> None:
    env = JobEnvironment.from_env(measured_het_step(procid, nodeid, localid))
    assert (env.rank, env.world_size, env.local_rank) == (procid, 4, localid)
    assert env.het_component() == component and env.local_world_size == local_world
    assert env.master_addr == "xnode1"


def test_plain_srun_inside_a_hetjob_spans_component_0_only() -> None:
    """The batch script exports every component's counts; a plain srun spans component 0 only."""
    env = JobEnvironment.from_env({**hetjob_env(procid=1), "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
                                   "SLURM_STEP_NODELIST": "node3", "SLURM_NODEID": "0", "SLURM_LOCALID": "1"})
    assert (env.rank, env.world_size, env.het_component(), env.het_group_sizes) == (1, 2, (0, 1), (2,))
    assert env.master_addr == "node3"


def test_a_training_step_beside_the_env_component_spans_the_first_components() -> None:
    """`srun --het-group=0-1` of a job whose last component holds environment workers: Slurm 22.05
    still says SLURM_HET_SIZE=3 there (measured on tools/slurm-local), the step has 3 tasks."""
    env = {**hetjob_env(procid=2), "SLURM_NTASKS_HET_GROUP_2": "2", "SLURM_STEP_NUM_TASKS": "3",
           "SLURM_NTASKS": "3"}
    job = JobEnvironment.from_env(env)
    assert (job.rank, job.world_size, job.het_group_sizes, job.het_component()) == (2, 3, (2, 1), (1, 0))
    assert JobEnvironment.from_env({**env, "SLURM_STEP_NUM_TASKS": "4"}).het_group_sizes is None


def test_hetjob_missing_component_count_is_explained() -> None:
    env = hetjob_env(procid=0)
    del env["SLURM_NTASKS_HET_GROUP_2"]
    with pytest.raises(ValueError, match="SLURM_NTASKS_HET_GROUP_2"):
        JobEnvironment.from_env(env)


def test_port_is_deterministic_per_job() -> None:
    first = JobEnvironment.from_env(slurm_env(SLURM_JOB_ID="4242", SLURM_PROCID="0"))
    again = JobEnvironment.from_env(slurm_env(SLURM_JOB_ID="4242", SLURM_PROCID="3", SLURM_RESTART_COUNT="1"))
    other = JobEnvironment.from_env(slurm_env(SLURM_JOB_ID="4243"))
    assert first.master_port == again.master_port == 29500 + 4242
    assert other.master_port == 29501 + 4242
    assert port_from_job_id("24242", 10000) == 10000 + 4242
    assert port_from_job_id("x7", 29500) == port_from_job_id("x7", 29500)
    assert 29500 <= port_from_job_id("x7", 29500) < 49500


def test_single_process_fallback() -> None:
    env = JobEnvironment.from_env({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.master_addr == "127.0.0.1" and 0 < env.master_port < 65536
    assert env.scheduler == "local" and env.job_id is None and env.restart_count == 0


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="VERL_HPC_WORLD_SIZE"):
        JobEnvironment.from_env({"VERL_HPC_RANK": "0", "VERL_HPC_WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="outside the world"):
        JobEnvironment.from_env({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize(("spec", "hosts"), [
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("a[1,3],b,c[2-3]x", ["a1", "a3", "b", "c2x", "c3x"]),
    ("", []),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]"])
def test_expand_hostlist_rejects_malformed(spec: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(spec)


def test_hostnames_prefers_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "scontrol"
    script.write_text("#!/bin/sh\necho from-scontrol-a\necho from-scontrol-b\n")
    script.chmod(0o755)
    assert hostnames("node[1-2]") == ["node1", "node2"]
    monkeypatch.setenv("PATH", str(fake))
    assert hostnames("node[1-2]") == ["from-scontrol-a", "from-scontrol-b"]
    script.write_text("#!/bin/sh\nexit 1\n")
    assert hostnames("node[1-2]") == ["node1", "node2"]


def test_parse_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        parse_tasks_per_node("2(3)")


def test_write_debug_file(tmp_path: Path) -> None:
    source = {**hetjob_env(procid=3), "CUDA_VISIBLE_DEVICES": "1", "NCCL_DEBUG": "INFO",
              "GLOO_SOCKET_IFNAME": "lo", "HOME": "/root", "SECRET_TOKEN": "x"}
    env = JobEnvironment.from_env(source)
    path = env.write_debug_file(tmp_path / "debug" / "rank3.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data["derived"]["rank"] == 3 and data["derived"]["world_size"] == 4
    assert data["derived"]["scheduler"] == "slurm" and data["het_component"] == [2, 0]
    assert data["variables"]["SLURM_NTASKS_HET_GROUP_0"] == "2"
    assert data["variables"]["CUDA_VISIBLE_DEVICES"] == "1" and data["variables"]["NCCL_DEBUG"] == "INFO"
    assert "HOME" not in data["variables"] and "SECRET_TOKEN" not in data["variables"]
    assert [p.name for p in path.parent.iterdir()] == ["rank3.json"]  # no temp file left behind
    env.write_debug_file(path)  # overwriting keeps the mode
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    """Ports the kernel hands to outgoing connections would race with the rendezvous (CI's EADDRINUSE)."""
    import socket

    from verl_hpc.runtime.process.env import SLURM_PORT_BASE, _ephemeral_start, free_port

    ports = {free_port() for _ in range(20)}
    assert len(ports) > 10  # drawn at random, not one fixed port
    for port in ports:
        assert 1024 <= port < _ephemeral_start()
        assert not SLURM_PORT_BASE <= port < SLURM_PORT_BASE + 1000
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
