"""A submitted Slurm job, seen through `scontrol`: state per component, logs, cancel.

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

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_hpc.config.placement import ProcessPlan, plan_for_config

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "BOOT_FAIL", "DEADLINE"})
REGISTRY_LIMIT = 500
TOOL_TIMEOUT_S = 30.0


class SlurmError(RuntimeError):
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


@dataclass
class SlurmJob:
    """One submitted run: the leader's job id, the job folder and (when known) the run directory."""

    job_id: str
    folder: Path
    run_dir: Path | None = None

    @classmethod
    def lookup(cls, job_id: str | int) -> SlurmJob:
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
        if self.run_dir is None or not (self.run_dir / "config.yaml").is_file():
            return None
        from verl_hpc.config import load_config

        return plan_for_config(load_config(self.run_dir / "config.yaml"))

    def status(self) -> dict[str, dict[str, Any]]:
        """State per component, keyed by process group name (`component<i>` if the plan is unknown)."""
        records = self.records()
        plan = self.plan()
        names = [g.name for g in plan.groups] if plan and len(plan.groups) == len(records) else []
        result = {}
        for index, record in enumerate(records):
            key = names[index] if names else f"component{index}"
            result[key] = {
                "component": index, "job_id": record.get("JobId", "?"), "state": record.get("JobState", "?"),
                "restarts": int(record.get("Restarts") or 0), "nodes": record.get("NodeList", ""),
                "reason": record.get("Reason", ""), "exit_code": record.get("ExitCode", ""),
                "finished": component_finished(record),
            }
        return result

    def finished(self) -> bool:
        """Whether every component is done for good (a requeued job is not)."""
        return all(c["finished"] for c in self.status().values())

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> dict[str, dict[str, Any]]:
        """Poll until every component is done; the final status, or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if all(c["finished"] for c in status.values()):
                return status
            if deadline is not None and time.monotonic() > deadline:
                states = ", ".join(f"{k}={v['state']}" for k, v in status.items())
                raise TimeoutError(f"job {self.job_id} not finished after {timeout:g} s: {states}")
            time.sleep(poll)

    def batch_log(self) -> Path:
        return self.folder / f"{self.job_id}_batch.out"

    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        """The batch log and per-rank logs (`logs/<group>_rank<N>.out`), narrowed by role/rank."""
        logs = self.folder / "logs"
        plan = self.plan()
        if role is None and rank is None:
            return [self.batch_log(), *sorted(logs.glob("*_rank*.out"), key=_rank_of)]
        if plan is None:
            pattern = f"{role or '*'}_rank{'*' if rank is None else rank}.out"
            return sorted(logs.glob(pattern), key=_rank_of)
        ranks = range(plan.world_size) if rank is None else [rank]
        if rank is not None and not 0 <= rank < plan.world_size:
            raise SlurmError(f"rank {rank} is outside the job's {plan.world_size} ranks")
        if role is not None:
            group = _group_named(plan, role)
            ranks = [r for r in ranks if r in plan.group_ranks(group)]
        return [logs / f"{plan.locate(r)[0].name}_rank{r}.out" for r in ranks]

    def logs(self, role: str | None = None, rank: int | None = None) -> str:
        """The selected log files' text, each under a `==> path <==` line (as `tail` does)."""
        parts = []
        for path in self.log_paths(role, rank):
            with contextlib.suppress(FileNotFoundError):
                parts.append(f"==> {path} <==\n{path.read_text(errors='replace')}")
        return "\n".join(parts)

    def cancel(self) -> None:
        """scancel the job: every component, every step (SIGTERM, then SIGKILL after KillWait)."""
        done = run_tool("scancel", self.job_id)
        if done.returncode != 0:
            raise SlurmError(f"scancel {self.job_id}: {(done.stderr or done.stdout).strip() or 'failed'}")

    def last_step(self) -> int | None:
        """The last step trainer rank 0 logged to metrics.jsonl, or None before the first one."""
        if self.run_dir is None:
            return None
        return last_metrics_step(self.run_dir / "tensorboard" / "metrics.jsonl")


def _group_named(plan: ProcessPlan, role: str) -> str:
    """A group by its name (trainer, rollout, ...) or by a role it hosts (actor, ref, ...)."""
    for group in plan.groups:
        if role == group.name or role in group.roles:
            return group.name
    known = sorted({g.name for g in plan.groups} | {r for g in plan.groups for r in g.roles})
    raise SlurmError(f"no role or group {role!r} in this job; it has {', '.join(known)}")


def _rank_of(path: Path) -> int:
    match = re.search(r"_rank(\d+)\.out$", path.name)
    return int(match.group(1)) if match else -1


def last_metrics_row(path: Path) -> dict | None:
    """The last complete line of a metrics.jsonl (reads only the file's tail)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65536))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            row = json.loads(line)
            int(row["step"])
            return row
    return None


def last_metrics_step(path: Path) -> int | None:
    """`step` of the last complete line of a metrics.jsonl."""
    row = last_metrics_row(path)
    return int(row["step"]) if row is not None else None


def registry_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "verl-hpc" / "jobs.json"


def read_registry() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(registry_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_job(job: SlurmJob) -> None:
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
