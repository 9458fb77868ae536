"""tools/slurm-local gives a real Slurm: 4 fake GPU nodes, hetjobs, preemption with requeue, clean stop.

These are the Slurm behaviours the launcher builds on (docs/slurm-local.md, shared notes): if one of
them changes (a Slurm upgrade, a config edit), these tests say so before the launcher's do.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODES = {"node1", "node2", "node3", "node4"}
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

HETJOB = """#!/bin/bash
#SBATCH -J het3 -o {out}
#SBATCH -N1 -n2 --gres=gpu:2
#SBATCH hetjob
#SBATCH -n1
#SBATCH hetjob
#SBATCH -n1
srun --het-group=0-2 bash -c 'echo $SLURM_PROCID $SLURM_HET_SIZE $CUDA_VISIBLE_DEVICES'
"""

# Preemptible job: USR1 (sent at preemption) leaves a marker and the job keeps going until the SIGTERM
# that follows GraceTime; the requeued run (SLURM_RESTART_COUNT=1) records its restart count and ends.
LOW_JOB = """#!/bin/bash
#SBATCH -J low -p low -N1 -n1 --requeue --signal=B:USR1@60 -o {d}/low.out --open-mode=append
count=${{SLURM_RESTART_COUNT:-0}}
echo "run $count $(date +%T)"
if [ "$count" -ge 1 ]; then echo "$count" > {d}/restart_count; exit 0; fi
trap 'echo "USR1 $(date +%T)"; echo usr1 > {d}/usr1_marker' USR1
touch {d}/started
for i in $(seq 600); do sleep 1 & wait $!; done
"""


def test_four_idle_nodes_and_two_partitions(slurm_cluster: SlurmCluster) -> None:
    lines = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %P %t").stdout.split("\n")
    rows = [line.split() for line in lines if line.strip()]
    assert {row[0] for row in rows} == NODES
    assert {row[2] for row in rows} == {"idle"}, rows
    assert {row[1] for row in rows} == {"low*", "high"}  # `*` marks the default partition
    low = slurm_cluster.run("scontrol", "show", "partition", "low").stdout
    high = slurm_cluster.run("scontrol", "show", "partition", "high").stdout
    assert "PriorityTier=1 " in low and "PreemptMode=REQUEUE" in low and "GraceTime=15" in low
    assert "PriorityTier=10 " in high and "PreemptMode=OFF" in high
    gres = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%G").stdout.split()
    assert set(gres) == {"gpu:4"}


def test_three_component_hetjob_runs_one_step_across_components(slurm_cluster: SlurmCluster,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "het.out"
    script = tmp_path / "het.sh"
    script.write_text(HETJOB.format(out=out))
    job = slurm_cluster.sbatch(str(script))
    assert slurm_cluster.wait_for(lambda: set(slurm_cluster.job_states(job)) <= DONE, timeout=60)
    records = slurm_cluster.job_records(job)
    assert [r.get("HetJobOffset") for r in records] == ["0", "1", "2"]
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert len({r["NodeList"] for r in records}) == 3  # components never share a node
    rows = sorted(line.split() for line in out.read_text().splitlines() if re.match(r"^\d+ ", line))
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3], rows
    assert {row[1] for row in rows} == {"3"}  # SLURM_HET_SIZE
    by_rank = {int(row[0]): row[2:] for row in rows}
    assert by_rank[0] == by_rank[1] == ["0,1"]  # component 0 asked --gres=gpu:2


def test_high_partition_preempts_and_requeues_low_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    deadline = time.monotonic() + 90
    script = tmp_path / "low.sh"
    script.write_text(LOW_JOB.format(d=tmp_path))
    low = slurm_cluster.sbatch(str(script))
    assert slurm_cluster.wait_for((tmp_path / "started").exists, timeout=20), slurm_cluster.job_records(low)
    nodes = len(set(slurm_cluster.run("sinfo", "-h", "-N", "-p", "high", "-o", "%N").stdout.split()))
    high = slurm_cluster.sbatch("-p", "high", f"-N{nodes}", "--exclusive", "-J", "high",
                                "-o", str(tmp_path / "high.out"), "--wrap", "sleep 1")
    assert slurm_cluster.wait_for((tmp_path / "usr1_marker").exists, timeout=10), "no USR1 at preemption"
    restarted = tmp_path / "restart_count"
    assert slurm_cluster.wait_for(restarted.exists, timeout=max(1.0, deadline - time.monotonic())), (
        f"low job not rerun: {slurm_cluster.job_records(low)}\n{(tmp_path / 'low.out').read_text()}")
    assert restarted.read_text().strip() == "1"
    assert slurm_cluster.wait_for(lambda: set(slurm_cluster.job_states(low)) <= DONE, timeout=20)
    record = slurm_cluster.job_records(low)[0]
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", record
    assert slurm_cluster.job_states(high) == ["COMPLETED"]
    assert "DUE TO PREEMPTION" in (tmp_path / "low.out").read_text()


def _pids(root: Path) -> dict[str, int]:
    return {f.stem: int(f.read_text().split()[0]) for f in sorted((root / "run").glob("*.pid"))}


def _processes_mentioning(slurm_cluster: SlurmCluster, root: Path) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and slurm_cluster.pid_running(int(entry.name)):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(root) in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def test_second_cluster_side_by_side_then_stop_leaves_nothing(slurm_cluster: SlurmCluster,
                                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("second")
    started = slurm_cluster.local("start", "--dir", str(root), timeout=120)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip().splitlines()[-1] == f"export SLURM_CONF={root / 'slurm.conf'}"
    second = dataclasses.replace(slurm_cluster, conf=root / "slurm.conf", owned=True)
    try:
        pids = _pids(root)
        assert set(pids) == {"munged", "slurmctld"} | {f"slurmd-{n}" for n in NODES}
        assert all(slurm_cluster.pid_running(pid) for pid in pids.values())
        port = re.compile(r"^(?:SlurmctldPort|NodeName).*?(?:Port)=(\d+)", re.M)
        assert not set(port.findall(second.conf.read_text())) & set(port.findall(slurm_cluster.conf.read_text()))
        again = slurm_cluster.local("start", "--dir", str(root))
        assert again.returncode == 1 and "already running" in again.stderr
        assert slurm_cluster.local("status", "--dir", str(root)).returncode == 0
        job = second.sbatch("-o", str(root / "sleeper.out"), "--wrap", f"echo $$ > {root}/sleeper.pid; sleep 300")
        assert second.wait_for((root / "sleeper.pid").exists, timeout=20), second.job_records(job)
        sleeper = int((root / "sleeper.pid").read_text())
    finally:
        stopped = slurm_cluster.local("stop", "--dir", str(root), timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert [name for name, pid in pids.items() if slurm_cluster.pid_running(pid)] == []
    assert not slurm_cluster.pid_running(sleeper)
    assert _processes_mentioning(slurm_cluster, root) == []
    assert slurm_cluster.local("status", "--dir", str(root)).returncode == 1
    assert slurm_cluster.local("stop", "--dir", str(root)).returncode == 0  # idempotent
    assert slurm_cluster.run("sinfo", "-h").returncode == 0  # the session cluster is untouched
