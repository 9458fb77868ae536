"""What a run's files say about it, whoever started it: its logs, its last step, its launcher.

Why one module under every kind of run: a `RunHandle` reads the same run directory whether
the run is a `verl-hpc train` on this machine or a Slurm job, so selecting a role's or a
rank's logs, the last logged step and "is the launcher of this run still alive" are
written once here. `Backend` is what each kind of run adds on top: where its state comes
from (a child process, `scontrol`, the run directory) and how it is cancelled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_hpc.config.placement import ProcessPlan, plan_for_config

LAUNCHER_FILE = "launcher.json"  # the live launcher of a local run: pid, host, command
METRICS_FILE = Path("tensorboard") / "metrics.jsonl"


class RunError(RuntimeError):
    """A request about a run that cannot be met (no such job, role or rank); one line saying why."""


class Backend(ABC):
    """Where a run's state comes from and how it is stopped; `RunHandle` is the same for every backend.

    `states()` answers one entry per process group (or one for the whole run when the
    plan is unknown) with the keys of a Slurm hetjob component: component, job_id, state,
    restarts, nodes, reason, exit_code, finished.
    """

    kind = "local"
    job_id: str | None = None
    folder: Path | None = None
    run_dir: Path | None = None

    @abstractmethod
    def states(self) -> dict[str, dict[str, Any]]:
        """The state per process group, now."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """None while the run is going; else 0 when it finished, non-zero when it failed or was stopped."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the run: its workers checkpoint at the step boundary first where they can."""

    @abstractmethod
    def log_paths(self, role: str | None = None, rank: int | None = None) -> list[Path]:
        """The run's log files, narrowed to a role (or group) and/or a global rank."""


def component(index: int, job_id: str, state: str, finished: bool, exit_code: str = "", nodes: str = "",
              reason: str = "", restarts: int = 0) -> dict[str, Any]:
    """One entry of `Backend.states()`."""
    return {"component": index, "job_id": job_id, "state": state, "restarts": restarts, "nodes": nodes,
            "reason": reason, "exit_code": exit_code, "finished": finished}


def run_plan(run_dir: Path | None) -> ProcessPlan | None:
    """The run's process plan, from its config.yaml (as resized), when there is one."""
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None
    from verl_hpc.config import load_config

    return plan_for_config(load_config(run_dir / "config.yaml"))


def group_named(plan: ProcessPlan, role: str) -> str:
    """A group by its name (trainer, rollout, ...) or by a role it hosts (actor, ref, ...)."""
    for group in plan.groups:
        if role == group.name or role in group.roles:
            return group.name
    known = sorted({g.name for g in plan.groups} | {r for g in plan.groups for r in g.roles})
    raise RunError(f"no role or group {role!r} in this run; it has {', '.join(known)}")


def rank_of(path: Path) -> int:
    match = re.search(r"_rank(\d+)\.out$", path.name)
    return int(match.group(1)) if match else -1


def rank_log_paths(logs: Path, plan: ProcessPlan | None, role: str | None, rank: int | None) -> list[Path]:
    """`logs/<group>_rank<N>.out` of the selected ranks (every rank's that exists when none is selected)."""
    if role is None and rank is None:
        return sorted(logs.glob("*_rank*.out"), key=rank_of)
    if plan is None:
        pattern = f"{role or '*'}_rank{'*' if rank is None else rank}.out"
        return sorted(logs.glob(pattern), key=rank_of)
    if rank is not None and not 0 <= rank < plan.world_size:
        raise RunError(f"rank {rank} is outside the run's {plan.world_size} ranks")
    ranks = list(range(plan.world_size)) if rank is None else [rank]
    if role is not None:
        group = group_named(plan, role)
        ranks = [r for r in ranks if r in plan.group_ranks(group)]
    return [logs / f"{plan.locate(r)[0].name}_rank{r}.out" for r in ranks]


def read_logs(paths: list[Path]) -> str:
    """The files' text, each under a `==> path <==` line (as `tail` does); missing files are left out."""
    parts = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            parts.append(f"==> {path} <==\n{path.read_text(errors='replace')}")
    return "\n".join(parts)


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


@contextlib.contextmanager
def recorded_launcher(run_dir: Path, command: list[str]) -> Iterator[None]:
    """`run_dir/launcher.json` names this process while it runs the run, so another shell can find it.

    Why: `verl-hpc status/cancel RUN_DIR` and `RunHandle(RUN_DIR)` must tell a running local
    run from one that ended, and stop it the way Ctrl-C does (SIGTERM to the launcher).
    """
    path = run_dir / LAUNCHER_FILE
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": command}
    tmp = path.with_name(f".{LAUNCHER_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()


def live_launcher(run_dir: Path) -> int | None:
    """The pid of the process running this run on this host, if it is still alive."""
    import psutil

    try:
        record = json.loads((run_dir / LAUNCHER_FILE).read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid)
        alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        started_before = proc.create_time() <= float(record.get("started", 0)) + 1.0  # not a reused pid
    except psutil.Error:
        return None
    return pid if alive and started_before else None
