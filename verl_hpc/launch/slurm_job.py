"""The Slurm backend of a `RunHandle`: a submitted job seen through `scontrol`, its logs, scancel.

Why scontrol and not submitit's `job.state`: without accounting (no slurmdbd, hence no
`sacct`) submitit's state stays UNKNOWN forever, and its `result()` hangs for a job that
left no result pickle, which ours never writes. `scontrol show job` works on every
cluster, for a hetjob prints one record per component, and keeps finished jobs for
`MinJobAge` seconds (300 by default).

Which run belongs to which job id is recorded at submission in
`${XDG_CACHE_HOME:-~/.cache}/verl-hpc/jobs.json`, so `verl-hpc status/logs JOB_ID`
find the run directory and job folder from another shell.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from verl_hpc.config.placement import ProcessPlan
from verl_hpc.launch.run_files import Backend, RunError, component, rank_log_paths, run_plan

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "BOOT_FAIL", "DEADLINE"})
REGISTRY_LIMIT = 500
TOOL_TIMEOUT_S = 30.0


class SlurmError(RunError):
    """A Slurm operation failed; the message is one line saying what to do."""


class SlurmToolsMissing(SlurmError):
    """Slurm's client commands are not on PATH (typical inside a container)."""

    def __init__(self, tool: str):
        super().__init__(
            f"Slurm's client tools are not on PATH ({tool} not found; common inside a container): "
            "render the script with `verl-hpc sbatch CONFIG --run-dir DIR --prepare > job.sbatch` and run "
            "`sbatch job.sbatch` from a login node (docs/slurm.md, 'Without scontrol or sbatch')")


def slurm_tool(name: str) -> str:
    """The path of a Slurm client command, or SlurmToolsMissing naming the fallback."""
    found = shutil.which(name)
    if found is None:
        raise SlurmToolsMissing(name)
    return found


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command with a timeout; the caller judges the exit code."""
    try:
        return subprocess.run([slurm_tool(name), *args], capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{name} {' '.join(args)} did not answer within {TOOL_TIMEOUT_S:g} s "
                         "(is slurmctld reachable?)") from None


def parse_records(text: str) -> list[dict[str, str]]:
    """`scontrol show job` output as one Key=Value dict per record (per hetjob component)."""
    chunks = [chunk for chunk in re.split(r"\n\s*\n", text) if "JobId=" in chunk]
    records = [dict(re.findall(r"(\w+)=(\S*)", chunk)) for chunk in chunks]
    return sorted(records, key=lambda r: int(r.get("HetJobOffset") or 0))


def component_finished(record: dict[str, str]) -> bool:
    """Done for good: a terminal state, or preempted without a requeue coming."""
    state = record.get("JobState", "")
    return state in TERMINAL_STATES or (state == "PREEMPTED" and record.get("Requeue") == "0")


def normalize_job_id(job_id: str | int) -> str:
    """`12`, or a component's `12+1`, as the leader's id `12`; anything else is an error."""
    match = re.fullmatch(r"\s*(\d+)(?:\+\d+)?\s*", str(job_id))
    if match is None:
        raise SlurmError(f"{job_id!r} is not a Slurm job id (a number, e.g. 1234)")
    return match.group(1)


class SlurmBackend(Backend):
    """One submitted run seen through scontrol: the leader's job id, the job folder, the run directory."""

    kind = "slurm"

    def __init__(self, job_id: str, folder: Path, run_dir: Path | None = None):
        self.job_id, self.folder, self.run_dir = job_id, Path(folder), run_dir

    @classmethod
    def lookup(cls, job_id: str | int) -> SlurmBackend:
        """Find a job's folder and run directory: the registry, checked against scontrol."""
        probe = cls(normalize_job_id(job_id), Path("."))
        stdout, missing = None, None
        try:
            stdout = (probe.records() or [{}])[0].get("StdOut")  # a component's id becomes the leader's
        except SlurmToolsMissing as err:  # the registry alone still finds the logs
            missing = err
        except SlurmError:
            pass
        job_id = probe.job_id
        entry = read_registry().get(job_id)
        if entry and (not stdout or Path(stdout).parent == Path(entry["folder"])):
            run_dir = entry.get("run_dir")
            return cls(job_id, Path(entry["folder"]), Path(run_dir) if run_dir else None)
        if stdout:  # not submitted from here (or the registry is stale): trust the controller
            folder = Path(stdout).parent
            run_dir = folder.parent if (folder.parent / "config.yaml").is_file() else None
            return cls(job_id, folder, run_dir)
        if missing is not None:
            raise missing
        raise SlurmError(f"job {job_id} is neither known to Slurm nor recorded in {registry_path()}")

    @classmethod
    def newest_for(cls, run_dir: Path) -> SlurmBackend | None:
        """The newest job this machine submitted for `run_dir` (the job registry), if any."""
        wanted = str(Path(run_dir).absolute())
        for job_id, entry in reversed(list(read_registry().items())):
            if entry.get("run_dir") == wanted:
                return cls(job_id, Path(entry["folder"]), Path(wanted))
        return None

    def records(self) -> list[dict[str, str]]:
        """scontrol's records of every component, in component order."""
        done = run_tool("scontrol", "show", "job", self.job_id)
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip().splitlines()
            raise SlurmError(f"scontrol show job {self.job_id}: {reason[-1] if reason else 'failed'} "
                             "(finished jobs are forgotten after MinJobAge seconds)")
        records = parse_records(done.stdout)
        leader = records[0].get("HetJobId") if records else None
        if leader and leader != self.job_id:  # asked about a component: show the whole job
            self.job_id = leader
            return self.records()
        return records

    def plan(self) -> ProcessPlan | None:
        """The run's process plan, from its config.yaml, when the run directory is known."""
        return run_plan(self.run_dir)

    def states(self) -> dict[str, dict[str, Any]]:
        """State per component, keyed by process group name (`component<i>` if the plan is unknown)."""
        records = self.records()
        plan = self.plan()
        names = [g.name for g in plan.groups] if plan else []
        names += ["env"] if len(records) == len(names) + 1 else []  # the environment workers' component
        names = names if len(names) == len(records) else []
        return {(names[i] if names else f"component{i}"): component(
            i, r.get("JobId", "?"), r.get("JobState", "?"), component_finished(r), r.get("ExitCode", ""),
            r.get("NodeList", ""), r.get("Reason", ""), int(r.get("Restarts") or 0))
            for i, r in enumerate(records)}

    def exit_code(self) -> int | None:
        """None until every component is done; then the job's exit code (`exit_code_of`)."""
        records = self.records()
        if not all(component_finished(r) for r in records):
            return None
        return exit_code_of(records)

    def batch_log(self) -> Path:
        return self.folder / f"{self.job_id}_batch.out"

    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        """The batch log and per-rank logs (`logs/<group>_rank<N>.out`), narrowed by role/rank."""
        ranks = rank_log_paths(self.folder / "logs", self.plan(), role, rank)
        return [self.batch_log(), *ranks] if role is None and rank is None else ranks

    def cancel(self) -> None:
        """scancel the job: every component, every step (SIGTERM, then SIGKILL after KillWait)."""
        done = run_tool("scancel", self.job_id)
        if done.returncode != 0:
            raise SlurmError(f"scancel {self.job_id}: {(done.stderr or done.stdout).strip() or 'failed'}")


def exit_code_of(records: list[dict[str, str]]) -> int:
    """0 when every component COMPLETED; else the first component's code (`N:S`: N, or 128+S by a signal)."""
    if all(r.get("JobState") == "COMPLETED" for r in records):
        return 0
    for record in records:
        code, _, sig = record.get("ExitCode", "0:0").partition(":")
        if int(code or 0):
            return int(code)
        if int(sig or 0):
            return 128 + int(sig)
    return 1  # cancelled before it ran, timed out, node failure: no code of its own


def registry_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "verl-hpc" / "jobs.json"


def read_registry() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(registry_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_job(job: SlurmBackend) -> None:
    """Remember job id -> folder and run dir; locked and atomic, as several submits may race."""
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_registry()
        data.pop(job.job_id, None)  # re-insert last: the newest entries survive trimming
        data[job.job_id] = {"folder": str(job.folder), "run_dir": str(job.run_dir) if job.run_dir else None,
                            "slurm_conf": os.environ.get("SLURM_CONF"), "submitted_at": time.time()}
        data = dict(list(data.items())[-REGISTRY_LIMIT:])
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
