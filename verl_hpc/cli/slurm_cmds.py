"""`verl-hpc submit | sbatch | status | logs | cancel`: the Slurm side of the CLI.

Why its own module: main.py stays the local story (train, config, checkpoints); these
commands share one error policy — a Slurm problem (tools missing, unknown job id, sbatch
refusing the job) is bad input for the user to fix, printed as one line with exit 2,
exactly like a config error. Heavy imports (submitit, torch) happen inside the commands.
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

if TYPE_CHECKING:
    from verl_hpc.launch.slurm_job import SlurmJob

EXIT_BAD_INPUT = 2
FOLLOW_POLL_S = 1.0


def _slurm_errors(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn SlurmError/TimeoutError into `verl-hpc: error: ...` and exit code 2."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        from verl_hpc.launch.slurm_job import SlurmError

        try:
            return func(args)
        except (SlurmError, TimeoutError) as err:
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
    p = sub.add_parser("status", help="a Slurm job's components, restarts, last step and per-role devices")
    p.add_argument("job_id", help="a Slurm job id, or a run directory (local runs)")
    p.set_defaults(func=_slurm_errors(_cmd_status))


def _add_logs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="print a Slurm job's logs: batch shell and every rank")
    p.add_argument("job_id")
    p.add_argument("--role", help="only this role's or group's ranks (actor, rollout, trainer, ...)")
    p.add_argument("--rank", type=int, help="only this global rank")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.set_defaults(func=_slurm_errors(_cmd_logs))


def _add_cancel(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cancel", help="cancel a Slurm job (all of its components)")
    p.add_argument("job_id")
    p.set_defaults(func=_slurm_errors(_cmd_cancel))


def _cmd_submit(args: argparse.Namespace) -> int:
    from verl_hpc.launch.slurm import submit

    result = submit(args.config, args.overrides, run_dir=args.run_dir, dry_run=args.dry_run, python=args.python)
    if isinstance(result, str):
        print(result, end="")
        return 0
    print(f"submitted job {result.job_id}")
    print(f"job folder: {result.folder}")
    print(f"run dir:    {result.run_dir}")
    print(f"follow it:  verl-hpc status {result.job_id}   verl-hpc logs {result.job_id} -f")
    return 0


def _cmd_sbatch(args: argparse.Namespace) -> int:
    from verl_hpc.config import load_config
    from verl_hpc.launch.sbatch import render_sbatch, render_template
    from verl_hpc.launch.slurm import JOB_FOLDER, prepare_submission, resolve_run_dir

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
    print(render_sbatch(cfg, path, path / JOB_FOLDER, args.python or sys.executable), end="")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from verl_hpc.launch.elastic import device_report
    from verl_hpc.launch.slurm_job import SlurmJob, last_metrics_step

    if Path(args.job_id).is_dir():  # a run directory (a local run): what the directory tells
        step = last_metrics_step(Path(args.job_id) / "tensorboard" / "metrics.jsonl")
        print(f"run dir: {args.job_id}   last step: {step if step is not None else 'none yet'}")
        from verl_hpc.utils.devices import get_gpu_usage

        print("\n".join(device_report(Path(args.job_id), get_gpu_usage()) + _time_budget(Path(args.job_id))))
        return 0
    job = SlurmJob.lookup(args.job_id)
    status = job.status()
    print(f"job {job.job_id}   run dir: {job.run_dir or 'unknown'}   job folder: {job.folder}")
    header = ("component", "group", "job id", "state", "restarts", "nodes", "reason")
    rows = [header] + [(str(c["component"]), name, c["job_id"], c["state"], str(c["restarts"]), c["nodes"],
                        c["reason"]) for name, c in status.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if job.run_dir is not None:
        step = job.last_step()
        print(f"last step: {step if step is not None else 'none yet'} (from {job.run_dir}/tensorboard/metrics.jsonl)")
        print("\n".join(device_report(job.run_dir) + _time_budget(job.run_dir)))
    return 0


def _time_budget(run_dir: Path) -> list[str]:
    """The time limit's lines: end time, step and save estimates, the last early stop (docs/slurm.md)."""
    from verl_hpc.launch.slurm_job import last_metrics_row
    from verl_hpc.metrics.history import read_history, time_budget_lines

    return time_budget_lines(read_history(run_dir), last_metrics_row(run_dir / "tensorboard" / "metrics.jsonl"))


def _cmd_logs(args: argparse.Namespace) -> int:
    from verl_hpc.launch.slurm_job import SlurmJob

    job = SlurmJob.lookup(args.job_id)
    if not args.follow:
        sys.stdout.write(job.logs(args.role, args.rank) or f"no logs yet in {job.folder}\n")
        return 0
    return _follow(job, args.role, args.rank)


def _follow(job: SlurmJob, role: str | None, rank: int | None) -> int:
    """Print what the selected logs gain, once a second, until the job is finished."""
    from verl_hpc.launch.slurm_job import SlurmError

    offsets: dict[Path, int] = {}
    current: Path | None = None
    while True:
        try:
            done = job.finished()
        except SlurmError:  # forgotten by the controller: nothing more will be written
            done = True
        for path in job.log_paths(role, rank):
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
    from verl_hpc.launch.slurm_job import SlurmJob, normalize_job_id

    job = SlurmJob(normalize_job_id(args.job_id), Path("."))
    job.cancel()
    print(f"cancelled job {job.job_id}")
    return 0


SLURM_PARSERS = (_add_submit, _add_sbatch, _add_status, _add_logs, _add_cancel)
