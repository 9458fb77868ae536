"""A real local Slurm cluster for the tests in this folder (see docs/slurm-local.md).

`slurm_cluster` starts one with `tools/slurm-local start` in a fresh temporary folder per session, or
reuses a running one when VERL_HPC_SLURM_CONF names its slurm.conf. Slurm missing and not installable:
the tests skip, except under CI (env CI set), where a skip would hide that nothing was tested.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "tools" / "slurm-local"
EXIT_UNAVAILABLE = 3  # tools/slurm-local: Slurm/munge missing and could not be installed


def slurm_local(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run tools/slurm-local with output captured as text."""
    return subprocess.run([str(SLURM_LOCAL), *args], text=True, capture_output=True, timeout=timeout,
                          check=False)


def pid_running(pid: int) -> bool:
    """True for a live process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class SlurmCluster:
    """Handle on the cluster the tests use; commands run with this cluster's SLURM_CONF."""

    conf: Path
    owned: bool
    # Helpers for the test module, which cannot import this conftest by name (tests/ has another).
    local = staticmethod(slurm_local)
    pid_running = staticmethod(pid_running)

    @property
    def root(self) -> Path:
        return self.conf.parent

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        result = subprocess.run(list(args), env=env, text=True, capture_output=True, timeout=timeout,
                                check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {result.returncode}\n{result.stdout}{result.stderr}")
        return result

    def sbatch(self, *args: str) -> int:
        """Submit a job; return its id (the leader's for a hetjob)."""
        return int(self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0].split("+")[0])

    def poke(self) -> None:
        """Make the scheduler run now (a requeued job can otherwise sit 60-110 s)."""
        slurm_local("poke", "--dir", str(self.root), timeout=30)

    def job_records(self, job_id: int) -> list[dict[str, str]]:
        """`scontrol show job` as one Key=Value dict per record (a hetjob has one per component)."""
        text = self.run("scontrol", "show", "job", str(job_id), check=False).stdout
        records = [chunk for chunk in re.split(r"\n\s*\n", text) if "JobId=" in chunk]
        return [dict(re.findall(r"(\w+)=(\S*)", chunk)) for chunk in records]

    def job_states(self, job_id: int) -> list[str]:
        return [record.get("JobState", "?") for record in self.job_records(job_id)]

    def wait_for(self, condition: Callable[[], bool], timeout: float, poke: bool = True) -> bool:
        """Poll `condition` once a second (poking the scheduler each time) until true or timeout."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            if poke:
                self.poke()
            time.sleep(1)
        return True


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"Slurm tests cannot run under CI: {reason}", pytrace=False)
    pytest.skip(f"Slurm not available: {reason}")


def _reuse(conf: Path) -> SlurmCluster:
    cluster = SlurmCluster(conf=conf, owned=False)
    if not conf.is_file():
        pytest.fail(f"VERL_HPC_SLURM_CONF={conf} does not exist", pytrace=False)
    result = cluster.run("sinfo", "-h", check=False)
    if result.returncode != 0:
        pytest.fail(f"VERL_HPC_SLURM_CONF={conf}: sinfo failed: {result.stderr}", pytrace=False)
    return cluster


def _start(root: Path) -> SlurmCluster:
    result = slurm_local("start", "--dir", str(root))
    if result.returncode == EXIT_UNAVAILABLE:
        _unavailable(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "exit 3")
    if result.returncode != 0:
        pytest.fail(f"tools/slurm-local start failed ({result.returncode}):\n{result.stdout}{result.stderr}",
                    pytrace=False)
    return SlurmCluster(conf=root / "slurm.conf", owned=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running local cluster; SLURM_CONF points at it in os.environ for the whole session."""
    reuse = os.environ.get("VERL_HPC_SLURM_CONF")
    cluster = _reuse(Path(reuse).resolve()) if reuse else _start(tmp_path_factory.mktemp("slurm"))
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if cluster.owned:
            slurm_local("stop", "--dir", str(cluster.root))
