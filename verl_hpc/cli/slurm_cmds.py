"""`verl-hpc submit | sbatch | status | logs | cancel`: submitting to Slurm, and any run's handle.

Why its own module: main.py stays the local story (train, config, checkpoints); these
commands go through an executor (`submit`) or a `RunHandle` (`status`, `logs`, `cancel`: a
Slurm job id, or a run directory — a local run's too) and share one error policy — a run
problem (Slurm's tools missing, an unknown job id, sbatch refusing the job, no such role) is
bad input for the user to fix, printed as one line with exit 2, exactly like a config
error. Heavy imports (submitit, torch) happen inside the commands.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from verl_hpc.config import ConfigError
from verl_hpc.utils.invocation import command_line

if TYPE_CHECKING:
    from verl_hpc.launch.handle import RunHandle

EXIT_BAD_INPUT = 2
FOLLOW_POLL_S = 1.0


def _slurm_errors(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn RunError (Slurm's included) and TimeoutError into `verl-hpc: error: ...` and exit code 2."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        from verl_hpc.launch.run_files import RunError

        try:
            return func(args)
        except (RunError, TimeoutError) as err:
            print(f"verl-hpc: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT

    return wrapper


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run config YAML")
    p.add_argument("overrides", nargs="*", help="Hydra-style key.path=value overrides")
    p.add_argument("--run-dir", help="run directory (default: run_dir from the config, else runs/<slurm.job_name>)")
    p.add_argument("--python", help="the Python the workers run, same path on every node (default: this one)")


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit the run to Slurm: one hetjob component per process group")
    _add_run_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print the script; create and submit nothing")
    p.set_defaults(func=_slurm_errors(_cmd_submit))


def _add_sbatch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sbatch", help="print the sbatch script `submit` would send")
    _add_run_arguments(p)
    p.add_argument("--prepare", action="store_true",
                   help="also prepare the run directory, so plain `sbatch` can run the script")
    p.add_argument("--template", action="store_true",
                   help="print a copyable template: run dir and Python as variables with portable defaults")
    p.set_defaults(func=_slurm_errors(_cmd_sbatch))


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="a run's state per component, restarts, last step and per-role devices")
    p.add_argument("job_id", help="a Slurm job id, or a run directory (local or submitted from here)")
    p.set_defaults(func=_slurm_errors(_cmd_status))


def _add_logs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="print a run's logs: the batch shell or launcher, and every rank")
    p.add_argument("job_id", help="a Slurm job id, or a run directory")
    p.add_argument("--role", help="only this role's or group's ranks (actor, rollout, trainer, ...)")
    p.add_argument("--rank", type=int, help="only this global rank")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.set_defaults(func=_slurm_errors(_cmd_logs))


def _add_cancel(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cancel", help="cancel a Slurm job (all of its components), or stop a local run")
    p.add_argument("job_id", help="a Slurm job id, or the run directory of a local run")
    p.set_defaults(func=_slurm_errors(_cmd_cancel))


def _cmd_submit(args: argparse.Namespace) -> int:
    from verl_hpc.launch.executor import SlurmExecutor

    executor = SlurmExecutor(args.python)
    if args.dry_run:
        print(executor.render(args.config, args.run_dir, args.overrides), end="")
        return 0
    handle = executor.submit(args.config, args.run_dir, args.overrides)
    print(f"submitted job {handle.job_id}")
    print(f"job folder: {handle.folder}")
    print(f"run dir:    {handle.run_dir}")
    print(f"follow it:  {command_line('status', str(handle.job_id))}   {command_line('logs', str(handle.job_id), '-f')}")
    return 0


def _cmd_sbatch(args: argparse.Namespace) -> int:
    from verl_hpc.config import load_config
    from verl_hpc.launch.executor import SlurmExecutor
    from verl_hpc.launch.sbatch import render_template
    from verl_hpc.launch.slurm import prepare_submission, resolve_run_dir

    cfg = load_config(args.config, args.overrides)
    if args.template:
        if args.prepare or args.run_dir or args.python:
            raise ConfigError("--template", "a template has no run directory or Python of its own",
                              "drop --run-dir/--python/--prepare, or drop --template")
        print(render_template(cfg), end="")
        return 0
    path = resolve_run_dir(cfg, args.run_dir)
    if args.prepare:
        prepare_submission(cfg, path)
        print(f"verl-hpc: prepared run directory {path}", file=sys.stderr)
    print(SlurmExecutor(args.python).render(cfg, path), end="")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from verl_hpc.launch.handle import RunHandle
    from verl_hpc.launch.slurm_job import SlurmError

    handle = RunHandle.attach(args.job_id)
    if handle.kind == "slurm":
        try:
            _print_job_table(handle)
            return 0
        except SlurmError:
            if not Path(args.job_id).is_dir():
                raise  # a job id the controller no longer knows; a run directory still tells its story
            handle = RunHandle(args.job_id, _run_directory(Path(args.job_id)))
    _print_local(handle)
    return 0


def _run_directory(run_dir: Path):  # -> RunDirectory
    from verl_hpc.launch.local_runs import RunDirectory

    return RunDirectory(run_dir.absolute())


def _print_local(handle: RunHandle) -> None:
    """A local run: its directory, last step, state (from its launcher and run state) and devices."""
    from verl_hpc.launch.elastic import device_report
    from verl_hpc.utils.devices import get_gpu_usage

    step = handle.last_step()
    print(f"run dir: {handle.run_dir}   last step: {step if step is not None else 'none yet'}")
    states = {c["state"] for c in handle.status().values()}
    launcher = f" (launcher pid {handle.job_id})" if handle.job_id and "RUNNING" in states else ""
    print(f"state: {', '.join(sorted(states))}{launcher}")
    print("\n".join(device_report(handle.run_dir, get_gpu_usage()) + _time_budget(handle.run_dir)))


def _print_job_table(handle: RunHandle) -> None:
    """A Slurm job: one row per component, then the run's last step and devices."""
    from verl_hpc.launch.elastic import device_report

    status = handle.status()
    print(f"job {handle.job_id}   run dir: {handle.run_dir or 'unknown'}   job folder: {handle.folder}")
    header = ("component", "group", "job id", "state", "restarts", "nodes", "reason")
    rows = [header] + [(str(c["component"]), name, c["job_id"], c["state"], str(c["restarts"]), c["nodes"],
                        c["reason"]) for name, c in status.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if handle.run_dir is not None:
        step = handle.last_step()
        print(f"last step: {step if step is not None else 'none yet'} (from {handle.run_dir}/tensorboard/metrics.jsonl)")
        print("\n".join(device_report(handle.run_dir) + _time_budget(handle.run_dir)))


def _time_budget(run_dir: Path) -> list[str]:
    """The time limit's lines: end time, step and save estimates, the last early stop (docs/slurm.md)."""
    from verl_hpc.launch.run_files import last_metrics_row
    from verl_hpc.metrics.history import read_history, time_budget_lines

    return time_budget_lines(read_history(run_dir), last_metrics_row(run_dir / "tensorboard" / "metrics.jsonl"))


def _cmd_logs(args: argparse.Namespace) -> int:
    from verl_hpc.launch.handle import RunHandle

    handle = RunHandle.attach(args.job_id)
    if not args.follow:
        sys.stdout.write(handle.logs(args.role, args.rank) or f"no logs yet in {handle.folder}\n")
        return 0
    return _follow(handle, args.role, args.rank)


def _follow(handle: RunHandle, role: str | None, rank: int | None) -> int:
    """Print what the selected logs gain, once a second, until the run is over."""
    from verl_hpc.launch.slurm_job import SlurmError

    offsets: dict[Path, int] = {}
    current: Path | None = None
    while True:
        try:
            done = handle.finished()
        except SlurmError:  # forgotten by the controller: nothing more will be written
            done = True
        for path in handle.log_paths(role, rank):
            current = _print_new(path, offsets, current)
        if done:
            return 0
        time.sleep(FOLLOW_POLL_S)


def _print_new(path: Path, offsets: dict[Path, int], current: Path | None) -> Path | None:
    """Print the bytes appended to `path` since the last call, under a header on file change."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offsets.get(path, 0))
            data = fh.read()
    except FileNotFoundError:
        return current
    if not data:
        return current
    offsets[path] = offsets.get(path, 0) + len(data)
    if path != current:
        print(f"==> {path} <==")
    sys.stdout.write(data.decode(errors="replace"))
    sys.stdout.flush()
    return path


def _cmd_cancel(args: argparse.Namespace) -> int:
    from verl_hpc.launch.handle import RunHandle

    handle = RunHandle.attach(args.job_id)
    handle.cancel()
    if handle.kind == "slurm":
        print(f"cancelled job {handle.job_id}")
    else:
        print(f"stopping {handle.run_dir}: SIGTERM to its launcher, which saves a checkpoint of the step first")
    return 0


SLURM_PARSERS = (_add_submit, _add_sbatch, _add_status, _add_logs, _add_cancel)
