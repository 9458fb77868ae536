"""`verl-hpc report RUN_DIR|JOB [--out DIR]`: a run's summary, one PNG of its curves, and an HTML page.

Why a command and not a notebook: on a cluster the question "is my run healthy, how much
did the requeues cost" comes from a shell on the login node, often about a Slurm job id.
"""

from __future__ import annotations

import argparse

from verl_hpc.config import ConfigError


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="summary + report.png/report.html of a run (finished, running or requeued)")
    p.add_argument("run", help="the run directory (or a Slurm job id)")
    p.add_argument("--out", help="where report.png and report.html go (default: RUN_DIR/report)")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from verl_hpc.launch.elastic import resolve_target
    from verl_hpc.metrics.report import NotARunDir
    from verl_hpc.metrics.report_render import write_report

    run_dir = resolve_target(args.run)
    try:
        summary, png, page = write_report(run_dir, args.out)
    except NotARunDir as err:
        raise ConfigError("run", str(err), "pass a run directory (runs/<name>) or the Slurm job id of a run") from None
    print(summary)
    print(f"png:          {png}")
    print(f"html:         {page}")
    return 0


REPORT_PARSERS = (_add_report,)
