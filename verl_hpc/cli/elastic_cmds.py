"""`verl-hpc resize | resubmit`: change a running run's resources (docs/elastic.md).

Why two commands: `resize` is what a user types (it only records a request; the run
acts on it at its next step boundary); `resubmit` is what a Slurm batch script runs
after its job step stopped for a resize, because a Slurm job cannot change its shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verl_hpc.cli.slurm_cmds import _slurm_errors


def _add_resize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("resize", help="move a running run's role to new resources at the next step boundary")
    p.add_argument("run", help="the run directory (or a Slurm job id)")
    p.add_argument("overrides", nargs="+", help="ROLE.FIELD=VALUE, e.g. reward.device_ids=[3,4]")
    p.set_defaults(func=_slurm_errors(_cmd_resize))


def _add_resubmit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("resubmit", help="(batch scripts) apply an accepted resize and submit the new job")
    p.add_argument("run_dir")
    p.add_argument("--python", help="the Python the workers run (default: this one)")
    p.set_defaults(func=_slurm_errors(_cmd_resubmit))


def _cmd_resize(args: argparse.Namespace) -> int:
    from verl_hpc.launch.elastic import resolve_target
    from verl_hpc.runtime.state.resize import request_resize

    run_dir = resolve_target(args.run)  # a job id: its run directory, through its RunHandle
    path = request_resize(run_dir, args.overrides)
    print(f"resize recorded in {path}")
    print("the run checkpoints at its next step boundary and restarts with the new resources "
          f"(history: {run_dir / 'config_history.yaml'})")
    return 0


def _cmd_resubmit(args: argparse.Namespace) -> int:
    from verl_hpc.launch.elastic import resubmit

    job = resubmit(Path(args.run_dir), args.python)
    print(f"verl-hpc: resized; submitted job {job.job_id} for {job.run_dir}", file=sys.stderr)
    print(job.job_id)
    return 0


ELASTIC_PARSERS = (_add_resize, _add_resubmit)
