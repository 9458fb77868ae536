"""Executors: where a run executes. `submit(config)` starts it and returns its `RunHandle`.

Why one interface (submitit's `Executor`): a run config is the same on a laptop and on a
cluster, so the code that starts runs — `verl-hpc train` and `submit`, the `HybridTrainer`
facade, a sweep script — should differ only in which executor it holds. Each executor also
has `render`, a dry run that shows exactly what `submit` would start, from the same inputs.

* `LocalExecutor`: this machine. In this process when the plan has one process, else the
  local launcher (`local.py`) as this process's child processes; in the foreground (submit
  returns when the run has ended) or, with `background=True`, as a `verl-hpc train` child
  process (submit returns at once).
* `SlurmExecutor`: one heterogeneous Slurm job, submitted through submitit (`slurm.py`).
"""

from __future__ import annotations

import os
import shlex
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from verl_hpc.config import ConfigError, RunConfig, dump_config, load_config
from verl_hpc.config.placement import plan_for_config
from verl_hpc.launch.handle import RunHandle
from verl_hpc.utils.fs import expand_path

ConfigSource = RunConfig | str | Path


def as_config(config: ConfigSource, overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig from a YAML path or a RunConfig, overrides applied either way."""
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        return load_config(data=config.model_dump(mode="json", by_alias=True), overrides=overrides)
    return load_config(config, overrides)


class Executor(ABC):
    """Starts runs somewhere; every executor answers with the same `RunHandle`."""

    @abstractmethod
    def run_dir_for(self, cfg: RunConfig, run_dir: str | Path | None, config: ConfigSource) -> Path:
        """The run directory `submit` uses: `run_dir`, else this executor's default for the config."""

    @abstractmethod
    def submit(self, config: ConfigSource, run_dir: str | Path | None = None,
               overrides: list[str] | None = None) -> RunHandle:
        """Validate, then start the run; bad input raises ConfigError before anything starts."""

    @abstractmethod
    def render(self, config: ConfigSource, run_dir: str | Path | None = None,
               overrides: list[str] | None = None) -> str:
        """Exactly what `submit` would start for the same arguments; creates nothing."""


class LocalExecutor(Executor):
    """This machine: in this process or the local launcher, in the foreground or in the background.

    `time_limit_s` (foreground): the run stops at its deadline, as a Slurm job would (`train`'s).
    """

    def __init__(self, background: bool = False, env: dict[str, str] | None = None,
                 time_limit_s: float | None = None):
        self.background, self.env, self.time_limit_s = background, dict(env or {}), time_limit_s

    def run_dir_for(self, cfg: RunConfig, run_dir: str | Path | None, config: ConfigSource) -> Path:
        """`run_dir`, else `runs/<trainer.run_name or config file stem>` (the same command resumes it)."""
        from verl_hpc.runtime.state.run_dir import named_run_dir

        if run_dir:
            return expand_path(str(run_dir))
        return named_run_dir(cfg, config if isinstance(config, str | Path) else None)

    def submit(self, config: ConfigSource, run_dir: str | Path | None = None, overrides: list[str] | None = None,
               *, actor_model: Any = None, reward_model: Any = None) -> RunHandle:
        """Run it. Foreground: returns once the run has ended (its failure is `result()`'s to raise);
        `actor_model`/`reward_model` objects reach a one-process run as they are."""
        from verl_hpc.checkpoint.layout import CheckpointError
        from verl_hpc.launch.local import WorkerFailure
        from verl_hpc.launch.local_runs import RanHere
        from verl_hpc.launch.train import train

        cfg = as_config(config, overrides)
        path = self.run_dir_for(cfg, run_dir, config)
        if self.background:
            return self._start_child(cfg, config, overrides, path, actor_model, reward_model)
        try:
            result = train(cfg, path, actor_model=actor_model, reward_model=reward_model,
                           time_limit_s=self.time_limit_s)
        except (WorkerFailure, CheckpointError) as failure:  # the run failed; bad input has raised already
            return RunHandle(path, RanHere(path, error=failure))
        return RunHandle(result.run_dir, RanHere(result.run_dir, result))

    def _start_child(self, cfg: RunConfig, config: ConfigSource, overrides: list[str] | None, path: Path,
                     actor_model: Any, reward_model: Any) -> RunHandle:
        from verl_hpc.config.machine import check_machine
        from verl_hpc.launch.local_runs import ChildProcess
        from verl_hpc.launch.train import check_local

        if actor_model is not None or reward_model is not None:
            raise ConfigError("actor_model", "objects cannot reach a run in the background (another process)",
                              "pass paths / module:function names in the config, or run in the foreground")
        if self.time_limit_s is not None:
            raise ConfigError("time_limit", "a time limit applies to a run in the foreground",
                              "drop --time-limit, or run in the foreground")
        check_local(cfg)
        check_machine(cfg)  # bad input fails here, not in the child's log
        if isinstance(config, RunConfig):
            config_file = Path(path).absolute() / "logs" / "submitted_config.yaml"
            config_file.parent.mkdir(parents=True, exist_ok=True)
            config_file.write_text(dump_config(cfg))
            config, overrides = config_file, []
        backend = ChildProcess.start(config, path, overrides, {**self.env})
        return RunHandle(backend.run_dir or path, backend)

    def render(self, config: ConfigSource, run_dir: str | Path | None = None,
               overrides: list[str] | None = None) -> str:
        cfg = as_config(config, overrides)
        path = self.run_dir_for(cfg, run_dir, config).absolute()
        child = None
        if self.background:
            source = Path(config).absolute() if isinstance(config, str | Path) else path / "logs/submitted_config.yaml"
            child = [sys.executable, "-m", "verl_hpc", "train", str(source), "--run-dir", str(path),
                     *(overrides if isinstance(config, str | Path) else [])]
        visible = {k: v for k, v in {**os.environ, **self.env}.items() if k == "CUDA_VISIBLE_DEVICES"}
        return render_local(cfg, path, sys.executable, child, visible)


def render_local(cfg: RunConfig, run_dir: Path, python: str, child: list[str] | None,
                 inherited: dict[str, str]) -> str:
    """What a local run starts: this process (one process), or one worker per rank with its variables.

    `child` is the `verl-hpc train` command of a background run; `inherited` the environment
    the launcher maps device ids through (CUDA_VISIBLE_DEVICES).
    """
    from verl_hpc.launch.worker_env import worker_env

    plan = plan_for_config(cfg)
    lines = [f"# run directory: {run_dir}"]
    if child is not None:
        lines.append(f"# in the background: {shlex.join(child)} >> {run_dir / 'logs' / 'launcher.out'} 2>&1")
    if plan.world_size == 1:
        from verl_hpc.runtime.embedded import hosted_roles

        roles = ", ".join(hosted_roles(cfg))
        lines.append(f"# one process ({roles}): the loop runs in {'that' if child else 'this'} process, "
                     f"logging to {run_dir / 'logs' / 'trainer_rank0.log'}")
        return "\n".join(lines) + "\n"
    lines.append(f"# {plan.world_size} processes, started and supervised by the local launcher; "
                 "MASTER_PORT is a free port chosen at launch")
    for rank in range(plan.world_size):
        env = worker_env(plan, rank, 0, run_dir, dict(inherited))
        shown = {k: v for k, v in env.items() if k not in inherited or inherited[k] != v}
        shown["MASTER_PORT"] = "PORT"
        group = env["VERL_HPC_GROUP"]
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
        lines.append(f"{assignments} {shlex.quote(python)} -m verl_hpc.runtime.worker "
                     f">> {run_dir / 'logs' / f'{group}_rank{rank}.out'} 2>&1")
    return "\n".join(lines) + "\n"


class SlurmExecutor(Executor):
    """One heterogeneous Slurm job: one component per process group, one step over all of them.

    `python` is the interpreter the workers run (default: this one; it must exist at the
    same path on the compute nodes).
    """

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def run_dir_for(self, cfg: RunConfig, run_dir: str | Path | None, config: ConfigSource) -> Path:
        """`run_dir`, else `cfg.run_dir`, else `runs/<slurm.job_name>`; absolute (`slurm.resolve_run_dir`)."""
        from verl_hpc.launch.slurm import resolve_run_dir

        return resolve_run_dir(cfg, run_dir)

    def render(self, config: ConfigSource, run_dir: str | Path | None = None,
               overrides: list[str] | None = None) -> str:
        """The sbatch script `submit` sends (`launch/sbatch.py`, a pure function of the config)."""
        from verl_hpc.launch.sbatch import render_sbatch
        from verl_hpc.launch.slurm import JOB_FOLDER

        cfg = as_config(config, overrides)
        refuse_bad_tools(cfg)
        path = self.run_dir_for(cfg, run_dir, config)
        return render_sbatch(cfg, path, path / JOB_FOLDER, self.python)

    def submit(self, config: ConfigSource, run_dir: str | Path | None = None,
               overrides: list[str] | None = None) -> RunHandle:
        """Validate, check Slurm's tools, prepare the run directory once, then sbatch the script."""
        import contextlib

        from verl_hpc.launch.container import image_problem
        from verl_hpc.launch.slurm import SUBMIT_TOOLS, HetjobExecutor, prepare_submission
        from verl_hpc.launch.slurm_job import SlurmBackend, SlurmError, record_job, slurm_tool
        from verl_hpc.runtime.state.run_dir import finished_step

        cfg = as_config(config, overrides)
        refuse_bad_tools(cfg)
        path = self.run_dir_for(cfg, run_dir, config)
        for tool in SUBMIT_TOOLS:
            slurm_tool(tool)
        problem = image_problem(cfg.slurm.container)  # before the run directory exists
        if problem is not None:
            raise SlurmError(problem)
        folder = prepare_submission(cfg, path)
        done = finished_step(path, cfg.trainer.total_steps)
        if done is not None:
            raise ConfigError("trainer.total_steps", f"{path} finished at step {done}: a job would have nothing "
                              "to train", "raise trainer.total_steps with --allow-config-change to train further")
        submitted = HetjobExecutor(folder, cfg, path, self.python).submit_run()
        job = SlurmBackend(str(submitted.job_id), folder, path)
        with contextlib.suppress(OSError):  # a read-only home must not fail a submitted job
            record_job(job)
        return RunHandle(path, job)


def refuse_bad_tools(cfg: RunConfig) -> None:
    """An agent run's tools and template are checked here, not in a job that waited in the queue."""
    if cfg.rollout.multi_turn.enable:
        from verl_hpc.launch.train import check_tools

        check_tools(cfg)


def submit(config_or_path: ConfigSource, overrides: list[str] | None = None, run_dir: str | Path | None = None,
           dry_run: bool = False, python: str | None = None) -> RunHandle | str:
    """Submit a run as one Slurm (het)job (`SlurmExecutor(python).submit`); with `dry_run`, only the script.

    `dry_run=True` validates and renders but creates nothing, neither files nor jobs.
    """
    executor = SlurmExecutor(python)
    if dry_run:
        return executor.render(config_or_path, run_dir, overrides)
    return executor.submit(config_or_path, run_dir, overrides)
