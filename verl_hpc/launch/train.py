"""`verl-hpc train`: the embedded loop for one process, the local launcher for more.

Why preparation happens here, once, before any worker starts: building the model,
writing the task's prompts and creating the run's secret are not safe to race from
several processes, and a bad config must fail before anything is spawned.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

from verl_hpc.config import ConfigError, RunConfig, dump_config
from verl_hpc.config.placement import ProcessPlan, plan_for_config
from verl_hpc.launch.run_files import recorded_launcher
from verl_hpc.runtime.build import ensure_model, prompt_files
from verl_hpc.runtime.lifecycle import TrainResult
from verl_hpc.runtime.state import resize
from verl_hpc.runtime.state.run_dir import finished_step, prepare_run_dir, write_explicit
from verl_hpc.utils.logging import get_logger

log = get_logger("launch")


def needs_launcher(cfg: RunConfig) -> bool:
    return plan_for_config(cfg).world_size > 1


def check_local(cfg: RunConfig) -> None:
    """Refuse what only Slurm can run: a role over several nodes (one machine here).

    Why before anything starts: the plan counts `nodes` x tasks per node processes, so a
    local launch would start them all on this machine and mislabel them as other nodes.
    """
    names = {"trainer": "actor"}
    for group in plan_for_config(cfg).groups:
        if group.resources.nodes > 1:
            role = names.get(group.name, group.name)
            raise ConfigError(f"resources.{role}.nodes", f"{group.resources.nodes} nodes need Slurm; "
                              "`verl-hpc train` runs every process on this machine",
                              "submit it with `verl-hpc submit CONFIG`, or set nodes: 1")


def check_tools(cfg: RunConfig) -> None:
    """Every agent tool imports, is typed and documented and has a valid schema, and the chat
    template can hold a tool conversation: refused here, before a run directory exists or a job
    is submitted, naming the entry (ConfigError). A model still to be built is probed when it is."""
    if cfg.rollout.multi_turn.enable:
        from verl_hpc.roles.agent.build import check_agent

        check_agent(cfg)


def prepare_run(cfg: RunConfig, run_dir: str | Path | None) -> Path:
    """Make the run directory ready for workers: config.yaml, the model, prompts, the secret.

    Why shared: the local launcher and `verl-hpc submit` need the same directory, made once
    by one process (none of these steps is safe to race from several workers).
    """
    from verl_hpc.transport.secret import create_run_secret

    path = prepare_run_dir(run_dir or cfg.run_dir, cfg)
    (path / "config.yaml").write_text(dump_config(cfg))
    write_explicit(path, cfg)
    ensure_model(cfg)
    prompt_files(cfg, path)
    create_run_secret(path)
    return path


def train(cfg: RunConfig, run_dir: str | Path | None = None, *, actor_model: Any = None,
          reward_model: Any = None, time_limit_s: float | None = None) -> TrainResult:
    """Run `cfg` here: in this process when its plan has one process (objects pass through as
    they are), else as one worker process per slot of the plan (only the config reaches them).

    `time_limit_s`: the run ends that many seconds from now, as a Slurm job at its time limit:
    it stops at the step boundary where the next step and a checkpoint no longer fit
    (`stopped_by` "deadline"); workers still running at the limit are stopped ("time limit").
    The same command run again resumes from the checkpoint. A run directory whose run already
    finished under this config's `trainer.total_steps` (only operational fields changed) is left
    as it is: nothing is loaded or trained.
    """
    from verl_hpc.config.machine import check_machine

    check_local(cfg)
    check_machine(cfg)  # devices, NCCL, the vLLM build: before the run directory exists
    check_tools(cfg)
    end_time = time.time() + time_limit_s if time_limit_s else None
    if not needs_launcher(cfg):
        from verl_hpc.runtime.embedded import train_in_process

        path = prepare_run_dir(run_dir or cfg.run_dir, cfg)
        if finished_step(path, cfg.trainer.total_steps) is not None:
            (path / "config.yaml").write_text(dump_config(cfg))  # the recorded change takes effect
            return finished_result(path)
        with recorded_launcher(path, sys.orig_argv):
            return train_in_process(cfg, path, actor_model, reward_model, end_time=end_time)
    if actor_model is not None or reward_model is not None:
        raise ConfigError("resources", "model or reward objects cannot reach the worker processes this "
                          "placement starts", "pass paths / module:function names in the config instead")
    return launch_local(cfg, run_dir, end_time)


def finished_result(path: Path) -> TrainResult:
    """What a finished run left: its last step's metrics and its exported model, if any."""
    step = finished_step(path)
    log.warning("%s finished at step %s: nothing to train (raise trainer.total_steps with "
                "--allow-config-change to train it further)", path, step)
    return read_result(path, None)


def read_result(path: Path, stopped_by: str | None) -> TrainResult:
    """The result of the run in `path` from its files: the last metrics row, `hf_model/` unless stopped."""
    from verl_hpc.metrics import read_jsonl_metrics

    metrics_file = path / "tensorboard" / "metrics.jsonl"
    rows = read_jsonl_metrics(metrics_file) if metrics_file.exists() else []
    hf_dir = path / "hf_model"
    return TrainResult(path, rows[-1]["step"] if rows else 0, hf_dir if hf_dir.exists() and not stopped_by else None,
                       rows[-1] if rows else {}, stopped_by)


def stopped_by(code: int) -> str | None:
    """What the launcher's exit code says stopped the run early (None: it ran to its end)."""
    from verl_hpc.launch.local import EXIT_TIME_LIMIT
    from verl_hpc.runtime.process.endtime import EXIT_AT_DEADLINE

    if code == EXIT_AT_DEADLINE:
        return "deadline"
    if code == EXIT_TIME_LIMIT:
        return "time limit"
    return signal.Signals(code - 128).name if code > 128 else None


def launch_local(cfg: RunConfig, run_dir: str | Path | None, end_time: float | None = None) -> TrainResult:
    path = prepare_run(cfg, run_dir)
    if finished_step(path, cfg.trainer.total_steps) is not None:
        return finished_result(path)
    if resize.history(path):
        log.warning("%s was resized before (%s); this launch uses the resources of the config given now",
                    path, path / resize.HISTORY_FILE)
    with recorded_launcher(path, sys.orig_argv):
        code = _supervise(cfg, path, end_time)
    if resize.pending(path):
        log.warning("a resize request in %s was not applied: the run ended first", path / resize.REQUEST_FILE)
    return read_result(path, stopped_by(code))


def _supervise(cfg: RunConfig, path: Path, end_time: float | None) -> int:
    """Run the world with `LocalLauncher` until it ends, restarting it on the new plan after each resize."""
    from verl_hpc.launch.local import LocalLauncher

    while True:
        plan = plan_for_config(cfg)
        launcher = LocalLauncher(plan, path, [sys.executable, "-m", "verl_hpc.runtime.worker"],
                                 env=_allocator_env(cfg.resources.host_allocator, plan),
                                 grace_seconds=min(10.0, cfg.resources.timeout_seconds), end_time=end_time)
        code = launcher.run()  # 128+signal when Ctrl-C/SIGTERM stopped it (workers saved first)
        if code != 0 or resize.accepted(path) is None:
            return code
        cfg = resize.apply_accepted(path)  # the workers stopped for a resize: restart on the new plan
        check_local(cfg)


def _allocator_env(choice: str, plan: ProcessPlan) -> dict[str, str]:
    """The preload the workers start with when all are on the CPU (one forked server serves them all);
    in a mixed plan each CPU worker restarts itself under it (runtime/worker.py)."""
    from verl_hpc.utils.host_allocator import usable_choice

    chosen = usable_choice(choice, {g.resources.device_type for g in plan.groups})
    return chosen.env if chosen is not None else {}
