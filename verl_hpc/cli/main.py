"""`verl-hpc` (and `python -m verl_hpc`): one entry point, one subcommand per action.

Why errors are caught here and nowhere else: a bad config must print exactly one line
naming the field and the fix and exit 2, before any process, job or file is created;
an unexpected failure still shows its traceback, because that is a bug to report.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from verl_hpc.cli.elastic_cmds import ELASTIC_PARSERS
from verl_hpc.cli.report_cmds import REPORT_PARSERS
from verl_hpc.cli.serve_cmds import SERVE_PARSERS
from verl_hpc.cli.slurm_cmds import SLURM_PARSERS
from verl_hpc.cli.verl_cmds import VERL_PARSERS
from verl_hpc.config import ConfigError
from verl_hpc.utils.invocation import command_line
from verl_hpc.utils.version import VERSION as __version__

EXIT_CONFIG_ERROR = 2
DESCRIPTION = ("RL post-training of LLMs (GRPO, PPO) from one YAML config: on this machine (`train`) "
               "or as one Slurm job (`submit`).")
EPILOG = """examples:
  verl-hpc train configs/quickstart.yaml                 # runs/quickstart; the same command resumes it
  verl-hpc train configs/quickstart.yaml trainer.total_steps=50 --run-dir runs/short
  verl-hpc config show configs/quickstart.yaml           # the resolved, validated config
  verl-hpc plan configs/smollm2_gsm8k.yaml               # the memory plan and estimate, without training
  verl-hpc ckpt list runs/quickstart
  verl-hpc serve configs/verifiers_calc.yaml --port 8000    # the policy at POST /inference/v1/generate
  verl-hpc verl algorithm.adv_estimator=grpo data.train_files=train.parquet ...   # a verl command line

Run `verl-hpc COMMAND --help` for a command's options; docs: README.md and docs/."""


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run the RL loop on this machine (no Slurm)")
    p.add_argument("config", help="run config YAML")
    p.add_argument("overrides", nargs="*", help="Hydra-style key.path=value overrides")
    p.add_argument("--run-dir", help="where outputs go (default: runs/<trainer.run_name>, else "
                   "runs/<config file name without .yaml>); an interrupted run resumes there")
    p.add_argument("--allow-config-change", action="store_true",
                   help="continue a run dir under a changed config (recorded in its config_history.yaml)")
    p.add_argument("--time-limit", metavar="TIME",
                   help="end the run after TIME (Slurm's format: minutes, MM:SS, HH:MM:SS, D-HH:MM:SS) as a Slurm "
                   "job would: it checkpoints at the last step boundary that fits and exits 3; run the same "
                   "command again to continue (docs/slurm.md, Time limits)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run (this process, or each worker with its variables); start nothing")
    p.set_defaults(func=_cmd_train)


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect configs")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    show = csub.add_parser("show", help="print the resolved, validated config as YAML")
    show.add_argument("config", help="run config YAML")
    show.add_argument("overrides", nargs="*", help="Hydra-style key.path=value overrides")
    show.set_defaults(func=_cmd_config_show)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print each process's memory plan and estimated peak, without training")
    p.add_argument("config", help="run config YAML")
    p.add_argument("overrides", nargs="*", help="Hydra-style key.path=value overrides")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from verl_hpc.config import load_config
    from verl_hpc.config.explicit import explicit_fields
    from verl_hpc.runtime.step.memory import plan_run

    cfg = load_config(args.config, args.overrides)
    plans = plan_run(cfg, explicit_fields(cfg))  # model.memory_plan: off estimates the switches as written
    if not plans:
        raise ConfigError("model.path", f"no config.json in {cfg.model.path} to read the model's shape from",
                          "build or download the model first (an init_preset model is built by `verl-hpc train`)")
    for plan in plans:
        print("\n".join(plan.lines()))
    return 0


def _add_init_model(sub: argparse._SubParsersAction) -> None:
    from verl_hpc.models.tiny import PRESETS

    p = sub.add_parser("init-model", help="build a random-weight model + locally trained tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace a model built earlier in OUT_DIR")
    p.set_defaults(func=_cmd_init_model)


def _cmd_train(args: argparse.Namespace) -> int:
    from verl_hpc.cli.run_report import restart_under_allocator, train_and_report
    from verl_hpc.config import load_config
    from verl_hpc.config.machine import check_machine
    from verl_hpc.launch.executor import LocalExecutor
    from verl_hpc.runtime.state.run_dir import ALLOW_ENV

    cfg = load_config(args.config, args.overrides)
    if not args.dry_run:
        restart_under_allocator(cfg, args.may_restart)  # may restart this command under TCMalloc
    check_machine(cfg)  # before the run dir exists: a mismatch must not leave one behind
    limit = _time_limit(args.time_limit)
    executor = LocalExecutor(time_limit_s=limit)
    run_dir = args.run_dir or str(executor.run_dir_for(cfg, None, args.config))
    if args.dry_run:
        print(executor.render(cfg, run_dir), end="")
        return 0
    if args.allow_config_change:
        os.environ[ALLOW_ENV] = "1"
    again = command_line("train", args.config, *args.overrides, "--run-dir", run_dir,
                         *(["--time-limit", args.time_limit] if args.time_limit else []))
    return train_and_report(cfg, run_dir, again, executor)


def _time_limit(text: str | None) -> float | None:
    from verl_hpc.runtime.process.endtime import parse_time_limit

    if text is None:
        return None
    try:
        return float(parse_time_limit(text))
    except ValueError as err:
        raise ConfigError("--time-limit", str(err), "for example --time-limit 30 (minutes) or 1:30:00") from None


def _cmd_config_show(args: argparse.Namespace) -> int:
    from verl_hpc.config import dump_config, load_config

    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from verl_hpc.models.tiny import init_model

    try:
        out = init_model(args.out_dir, preset=args.preset, seed=args.seed, overwrite=args.overwrite)
    except FileExistsError as err:
        raise ConfigError("out_dir", str(err)) from None
    print(f"model and tokenizer ({args.preset}, seed {args.seed}) in {out}")
    return 0


def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="inspect a run's checkpoints")
    csub = p.add_subparsers(dest="ckpt_cmd", required=True)
    ls = csub.add_parser("list", help="table of RUN_DIR/checkpoints: committed, partial and corrupt ones")
    ls.add_argument("run_dir")
    ls.add_argument("--verify", choices=["sizes", "sha256"], default="sizes",
                    help="sha256 re-reads every file (slow, finds bit flips)")
    ls.set_defaults(func=_cmd_ckpt_list)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    p.add_argument("checkpoint", help="a step_N checkpoint directory, or a run directory (its latest)")
    p.add_argument("out_dir")
    p.add_argument("--model-dir", help="the original model (default: the one recorded in the checkpoint)")
    p.add_argument("--prefix", default="actor.model.", help="state key prefix of the policy's weights")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write the adapter alone (peft's format) instead of the merged model")
    p.set_defaults(func=_cmd_export)


def _cmd_ckpt_list(args: argparse.Namespace) -> int:
    from verl_hpc.checkpoint.layout import CheckpointError, checkpoints_root, format_table, list_checkpoints

    try:
        root = checkpoints_root(args.run_dir)
    except CheckpointError as err:
        raise ConfigError("run_dir", str(err)) from None
    infos = list_checkpoints(root, verify=args.verify)
    print(format_table(infos) if infos else f"no checkpoints in {root}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from verl_hpc.checkpoint.export import export_hf
    from verl_hpc.checkpoint.layout import CheckpointError, resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        out = export_hf(ckpt, args.out_dir, args.model_dir, args.prefix, adapter=args.adapter)
    except CheckpointError as err:
        raise ConfigError("checkpoint", str(err)) from None
    print(f"exported {ckpt} to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-hpc", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"verl-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_config, _add_plan, _add_init_model, _add_ckpt, _add_export, *SLURM_PARSERS,
                *ELASTIC_PARSERS, *REPORT_PARSERS, *SERVE_PARSERS, *VERL_PARSERS):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`train CFG --run-dir D a.b=1`).
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e or e.startswith("~") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # Only the program itself may restart (under another allocator): main() called from Python may not.
    args.may_restart = argv is None
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"verl-hpc: error: {err.one_line()}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        print("verl-hpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
