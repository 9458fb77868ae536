"""`verl-hpc verl KEY=VALUE ...`: a verl run script's command line, run here.

Why a subcommand of its own: verl users arrive with `python3 -m verl.trainer.main_ppo`
and a page of Hydra overrides. Replacing the module with `verl-hpc verl` runs the same
run here (locally, or `--submit` as one Slurm job), and `--print-config` shows the
verl-hpc YAML it made, with the batch sizes restated in sequences, to keep and edit.
The mapping itself is config/verl_args.py (docs/verl.md is generated from it).
"""

from __future__ import annotations

import argparse
import sys

from verl_hpc.config import ConfigError
from verl_hpc.utils.invocation import command_line


def _add_verl(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verl", help="run verl's command line (`python3 -m verl.trainer.main_ppo KEY=VALUE ...`) here",
                       description="Takes the overrides a verl run script gives verl.trainer.main_ppo; every key "
                       "left out has verl 0.9.1's default. docs/verl.md lists the keys.")
    p.add_argument("overrides", nargs="*", help="verl's overrides, e.g. algorithm.adv_estimator=grpo "
                   "data.train_batch_size=256 actor_rollout_ref.rollout.n=8")
    p.add_argument("--print-config", action="store_true", help="print the verl-hpc YAML it makes; run nothing")
    p.add_argument("--submit", action="store_true", help="submit the run to Slurm as one job instead of running it")
    p.add_argument("--dry-run", action="store_true", help="with --submit: print the sbatch script, submit nothing")
    p.add_argument("--run-dir", help="where outputs go (default: trainer.default_local_dir, verl's "
                   "checkpoints/<project_name>/<experiment_name>)")
    p.add_argument("--python", help="with --submit: the Python the workers run (default: this one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="a verl-hpc override on the made config (repeatable), e.g. --set slurm.time=04:00:00")
    p.set_defaults(func=_cmd_verl)


def made_config(overrides: list[str], sets: list[str]):  # -> tuple[Conversion, RunConfig]
    """verl's overrides -> (the conversion, with `sets` applied, and the validated RunConfig)."""
    from verl_hpc.config import load_config
    from verl_hpc.config.loader import apply_overrides
    from verl_hpc.config.verl_args import parse_overrides, verl_to_config

    given = parse_overrides(overrides)
    rows = None if given.get("trainer.total_training_steps") is not None else _train_rows(given)
    conversion = verl_to_config(overrides, rows)
    conversion.config = apply_overrides(conversion.config, sets)
    return conversion, load_config(data=conversion.config)


def _train_rows(given: dict) -> int | None:
    """Rows of data.train_files (for trainer.total_epochs); None when a file cannot be read here."""
    from verl_hpc.config.verl_keys import DEFAULTS
    from verl_hpc.data.prompts import count_rows
    from verl_hpc.utils.fs import expand_path

    files = given.get("data.train_files", DEFAULTS["data.train_files"])
    total = 0
    for name in files if isinstance(files, list) else [files]:
        path = expand_path(str(name))
        if not path.exists():
            raise ConfigError("data.train_files", f"{path} does not exist", "check the path, or give "
                              "trainer.total_training_steps")
        total += count_rows(path)
    return total


def _cmd_verl(args: argparse.Namespace) -> int:
    from verl_hpc.cli.run_report import restart_under_allocator, train_and_report
    from verl_hpc.config.machine import check_machine
    from verl_hpc.runtime.state.run_dir import named_run_dir

    conversion, cfg = made_config(args.overrides, args.sets)
    if args.print_config:
        print(conversion.yaml(), end="")
        return 0
    for key, value, why in conversion.ignored:
        print(f"verl-hpc: ignored {key}={value!r}: {why}", file=sys.stderr)
    if args.submit:
        return _submit(cfg, args)
    restart_under_allocator(cfg, args.may_restart)  # may restart this command under TCMalloc
    check_machine(cfg)
    run_dir = args.run_dir or str(named_run_dir(cfg, None))
    again = command_line("verl", *args.overrides, *(f"--set={s}" for s in args.sets), "--run-dir", run_dir)
    return train_and_report(cfg, run_dir, again)


def _submit(cfg, args: argparse.Namespace) -> int:  # cfg: RunConfig
    from verl_hpc.launch.executor import SlurmExecutor
    from verl_hpc.launch.slurm_job import SlurmError

    executor = SlurmExecutor(args.python)
    try:
        if args.dry_run:
            print(executor.render(cfg, args.run_dir), end="")
            return 0
        handle = executor.submit(cfg, args.run_dir)
    except (SlurmError, TimeoutError) as err:
        print(f"verl-hpc: error: {err}", file=sys.stderr)
        return 2
    print(f"submitted job {handle.job_id}")
    print(f"run dir:    {handle.run_dir}")
    print(f"follow it:  {command_line('status', str(handle.job_id))}   {command_line('logs', str(handle.job_id), '-f')}")
    return 0


VERL_PARSERS = (_add_verl,)
