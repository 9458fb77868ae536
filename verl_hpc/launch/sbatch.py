"""The sbatch script of a run: a pure function of the config, golden-tested and dry-runnable.

Why one function and no I/O: `verl-hpc submit` sends it, `verl-hpc sbatch` prints it, the
templates in `sbatch/` are its output, and the tests compare it to golden files, so all
four must be the same text from the same inputs. Nothing here reads the environment or
the disk; paths, the Python and the version are arguments.

Layout: one hetjob component per `ProcessPlan` group, in plan order, because
`srun --het-group=0-N` numbers tasks contiguously per component in that order, which is
exactly how the plan assigns global ranks (verl_hpc/config/placement.py). A plan with one
group renders a plain job: Slurm refuses `--het-group` outside a hetjob (measured).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from verl_hpc.config import ConfigError, RoleResources, RunConfig
from verl_hpc.config.placement import GroupSpec, ProcessPlan, plan_for_config
from verl_hpc.config.resources import EnvResources
from verl_hpc.launch.container import after_step, container_block, uses_container
from verl_hpc.utils.version import VERSION as __version__

WORKER_MODULE = "verl_hpc.runtime.worker"
ENV_MODULE = "verl_hpc.roles.env.remote"
# #SBATCH lines are split on whitespace by sbatch, and quoting there is not shell quoting.
_SBATCH_VALUE = re.compile(r"^[^\s'\"\\]+$")
# Variables of the submitting shell (sbatch exports it to the job) that would override
# Slurm's description of the tasks: JobEnvironment prefers them (verl_hpc/runtime/process/env.py).
_STALE_LAUNCHER_VARS = "VERL_HPC_RANK VERL_HPC_WORLD_SIZE RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE"
# Left in the log folder by each task once it ignores USR1; + its SLURM_PROCID (see _signal_block).
READY_PREFIX = ".usr1_ready_${SLURM_JOB_ID:-0}_"
READY_MARKER = READY_PREFIX + "${SLURM_RESTART_COUNT:-0}_"


@dataclass(frozen=True)
class ScriptPaths:
    """Where the script points, as shell text: escaped absolute paths, or a template's defaults."""

    run_dir: str
    python: str
    log_dir: str
    output: str
    usage: tuple[str, ...]
    template: bool = False


def render_sbatch(cfg: RunConfig, run_dir: Path, job_folder: Path, python: str = sys.executable,
                  version: str = __version__) -> str:
    """The heterogeneous sbatch script that runs `cfg` in `run_dir`, job files in `job_folder`.

    Both paths must be absolute: the script runs on another machine, in another directory.
    """
    _check_values(cfg)
    for name, path in (("run_dir", run_dir), ("job_folder", job_folder)):
        if not Path(path).is_absolute():
            raise ValueError(f"{name} must be an absolute path, got {path}")
    paths = ScriptPaths(
        run_dir=_dq(str(run_dir)), python=_dq(python), log_dir=_dq(str(Path(job_folder) / "logs")),
        output=_sbatch_value("run_dir", f"{job_folder}/%j_batch.out"),
        usage=("Rendered by `verl-hpc sbatch`; `verl-hpc submit` sends exactly this text.",
               "Plain `sbatch THIS_FILE` works too once the run directory is prepared (docs/slurm.md)."))
    return _render(cfg, paths, version)


def render_template(cfg: RunConfig, version: str = __version__) -> str:
    """The script of `cfg` as a copyable template: no machine-specific path in it.

    Differences from `render_sbatch`, all in the path variables: the run directory defaults
    to `$PWD/runs/<job_name>`, the Python to `python3` from the submitting shell's PATH, and
    the batch log goes to the submission directory (`#SBATCH` lines cannot use variables).
    """
    _check_values(cfg)
    paths = ScriptPaths(
        run_dir=f"$PWD/runs/{_dq(cfg.slurm.job_name)}", python="python3",
        log_dir="$VERL_HPC_RUN_DIR/slurm/logs", output="%x-%j.out", template=True,
        usage=("Template: `verl-hpc sbatch CONFIG --template` prints it (docs/slurm.md, Templates). To run it:",
               "  verl-hpc sbatch CONFIG --run-dir DIR --prepare >/dev/null   # config.yaml, model, prompts, secret",
               "  VERL_HPC_RUN_DIR=DIR sbatch THIS_FILE"))
    return _render(cfg, paths, version)


def _render(cfg: RunConfig, paths: ScriptPaths, version: str) -> str:
    plan = plan_for_config(cfg)
    lines = [*_header(cfg, plan, paths, version), *_job_options(cfg, paths)]
    for index, group in enumerate(plan.groups):
        if index:
            lines.append("#SBATCH hetjob")
        lines.extend(_component(plan, index, group))
    if cfg.resources.env is not None:
        lines += ["#SBATCH hetjob", *_env_component(cfg.resources.env, len(plan.groups))]
    in_image = paths.template or uses_container(cfg)
    env_step = _env_step(len(plan.groups), in_image) if cfg.resources.env is not None else []
    lines += ["", *_prologue(cfg, paths), "", *_signal_block(cfg, plan), "", *env_step,
              *_step(plan, in_image, after_step(cfg, paths.template), bool(env_step))]
    return "\n".join(lines) + "\n"


def _header(cfg: RunConfig, plan: ProcessPlan, paths: ScriptPaths, version: str) -> list[str]:
    count = len(plan.groups) + (cfg.resources.env is not None)
    shape = f"{count} hetjob components" if count > 1 else "1 component (a plain job, no hetjob)"
    return [
        "#!/bin/bash",
        f"# verl-hpc {version}: job {cfg.slurm.job_name}, {cfg.algorithm.name.upper()} with "
        f"{cfg.resources.placement} placement, {shape}, {plan.world_size} processes.",
        *(f"# {line}" for line in paths.usage),
        "#",
        "# sbatch reads the #SBATCH lines up to the first command. Job-wide options come first (they",
        "# belong to the first component); then one block per process group of the run, in plan order,",
        "# separated by `#SBATCH hetjob`. srun numbers the tasks of all components contiguously in that",
        "# order, which is how every worker knows its global rank, its group and its roles.",
    ]


def _job_options(cfg: RunConfig, paths: ScriptPaths) -> list[str]:
    slurm = cfg.slurm
    return [
        "#",
        "# ---- job-wide ----",
        f"#SBATCH --job-name={slurm.job_name}",
        f"#SBATCH --time={slurm.time}",
        "#SBATCH --requeue" if slurm.requeue else "#SBATCH --no-requeue",
        f"#SBATCH --signal=B:USR1@{slurm.signal_grace_seconds}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={paths.output}",
    ]


def _component(plan: ProcessPlan, index: int, group: GroupSpec) -> list[str]:
    res = group.resources
    start = sum(g.size for g in plan.groups[:index])
    ranks = f"rank {start}" if group.size == 1 else f"ranks {start}-{start + group.size - 1}"
    per_node = tasks_per_node(res)
    lines = [
        "#",
        f"# ---- component {index}: group {group.name} (roles: {', '.join(group.roles)}), "
        f"{_count(res.nodes, 'node')} x {_count(per_node, 'task')} = {ranks} ----",
        f"#SBATCH --nodes={res.nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
    ]
    gpus = gpus_per_node(res)
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines.append(f"#SBATCH --cpus-per-task={res.cpus_per_task}")
    lines += [f"#SBATCH --{flag}={value}" for flag, value in _optional_flags(res) if value is not None]
    return lines


def _env_component(env: EnvResources, index: int) -> list[str]:
    """The environment workers' component: CPU nodes, one task per worker, no GPUs."""
    return [
        "#",
        f"# ---- component {index}: environment workers (resources.env), {_count(env.nodes, 'node')} x "
        f"{_count(env.workers_per_node, 'task')}, no GPUs; not ranks of the training world ----",
        f"#SBATCH --nodes={env.nodes}",
        f"#SBATCH --ntasks-per-node={env.workers_per_node}",
        f"#SBATCH --cpus-per-task={env.cpus_per_worker}",
        *(f"#SBATCH --{flag}={value}" for flag, value in _optional_flags(env) if value is not None),
    ]


def _env_step(index: int, in_image: bool) -> list[str]:
    srun = f"srun --het-group={index} --kill-on-bad-exit=0" + (' "${in_image[@]}"' if in_image else "")
    return [
        f"# ---- environment workers: component {index}, a job step of their own, started first ----",
        "# Each task announces its port under $VERL_HPC_RUN_DIR/env_workers/<job>.<restart>/ and restarts its",
        "# worker when it dies; the rollout connects with the run's token. Stopped when training ends.",
        f'{srun} bash -c \'exec "$@" >>"$VERL_HPC_LOG_DIR/env_worker${{SLURM_PROCID:-0}}.out" 2>&1\' '
        f'env_worker "$VERL_HPC_PYTHON" -m {ENV_MODULE} "$VERL_HPC_RUN_DIR" &',
        "env_pid=$!",
        "",
    ]


def _optional_flags(res: RoleResources | EnvResources) -> tuple[tuple[str, str | None], ...]:
    return (("mem", res.mem), ("partition", res.partition), ("account", res.account), ("qos", res.qos),
            ("constraint", res.constraint))


def _check_values(cfg: RunConfig) -> None:
    """Every config value that lands in an #SBATCH line, checked before anything is rendered."""
    _sbatch_value("slurm.job_name", cfg.slurm.job_name)
    _sbatch_value("slurm.time", cfg.slurm.time)
    places = [(group.roles[0], group.resources) for group in plan_for_config(cfg).groups]
    for role, res in places + ([("env", cfg.resources.env)] if cfg.resources.env is not None else []):
        for flag, value in _optional_flags(res):
            if value is not None:
                _sbatch_value(f"resources.{role}.{flag}", value)


def tasks_per_node(res: RoleResources) -> int:
    """Tasks on each node of a component: `tasks_per_node`, else one per device slot."""
    return res.tasks_per_node or len(res.device_ids) // res.devices_per_process


def gpus_per_node(res: RoleResources) -> int:
    """GPUs to request per node: none for CPU roles, else `gpus_per_node` or one per task."""
    if res.device_type != "cuda":
        return 0
    return res.gpus_per_node if res.gpus_per_node is not None else tasks_per_node(res) * res.devices_per_process


def _prologue(cfg: RunConfig, paths: ScriptPaths) -> list[str]:
    setup = list(cfg.slurm.setup) or ["# (none)"]
    return [
        "set -euo pipefail",
        "",
        "# ---- paths: edit here, or set them in the environment of `sbatch` (it exports it to the job) ----",
        "# The prepared run directory (config.yaml, data/, secrets/), on a file system every node sees:",
        f'export VERL_HPC_RUN_DIR="${{VERL_HPC_RUN_DIR:-{paths.run_dir}}}"',
        "# A Python with verl_hpc installed, at this path on every node:",
        f'VERL_HPC_PYTHON="${{VERL_HPC_PYTHON:-{paths.python}}}"',
        "# Each worker appends its output to <group>_rank<N>.out here (srun's %j and %t are wrong in a",
        "# het step); the structured logs and env_*.json debug files go to $VERL_HPC_RUN_DIR/logs.",
        f'export VERL_HPC_LOG_DIR="{paths.log_dir}"',
        "",
        'if [ ! -f "$VERL_HPC_RUN_DIR/config.yaml" ]; then',
        '  echo "verl-hpc: no $VERL_HPC_RUN_DIR/config.yaml: prepare the run directory first" \\',
        '       "(verl-hpc sbatch CONFIG --run-dir DIR --prepare)" >&2',
        "  exit 2",
        "fi",
        'mkdir -p "$VERL_HPC_LOG_DIR"',
        "# Launcher variables inherited from the submitting shell would override Slurm's view of the tasks.",
        f"unset {_STALE_LAUNCHER_VARS}",
        "",
        "# ---- slurm.setup: modules, environments, NCCL_*/GLOO_* variables (docs/slurm.md) ----",
        *setup,
        "",
        *(block + [""] if (block := container_block(cfg, paths.template)) else []),
        'echo "verl-hpc: job ${SLURM_JOB_ID:-none} restart ${SLURM_RESTART_COUNT:-0} on $(hostname) at $(date \'+%F %T\')"',
    ]


def _signal_block(cfg: RunConfig, plan: ProcessPlan) -> list[str]:
    grace = cfg.slurm.signal_grace_seconds
    return [
        "# ---- signals ----",
        "# The workers stop by themselves, before any signal: rank 0 reads the job's EndTime and all stop",
        "# at the step boundary where the next step, a checkpoint and slurm.requeue_margin_seconds no",
        "# longer fit, save, and rank 0 requeues the job, which resumes from that checkpoint.",
        f"# SIGUSR1 is the backstop. It reaches this batch shell only (--signal=B:USR1@{grace}): {grace} s",
        "# +- 30 s before the time limit (Slurm checks limits twice a minute), and at once when a",
        "# higher-priority job preempts this one. The trap sends it to srun, which relays it to every task",
        "# of every component: without a known end time, or for a preemption, the workers finish the",
        "# step, save a checkpoint, and rank 0 requeues the job.",
        "# SIGTERM (scancel, scontrol requeue, the end of a preemption's grace time, the time limit)",
        "# reaches every task directly from Slurm, then SIGKILL after the cluster's KillWait. A SIGTERM",
        "# sent to this shell alone (scancel -b) is passed on with `scancel --signal=TERM`: srun turns a",
        "# SIGTERM of its own into an immediate SIGKILL of every task (measured), which would skip the",
        "# final checkpoint. Workers may therefore see SIGTERM twice.",
        "# A USR1 can come before the workers are ready for it (a preemption right at start-up): each",
        "# task ignores USR1 from its first command on and then leaves a marker here; this shell passes",
        "# USR1 on only once every task has left one (until its `trap` runs, USR1 would kill a task),",
        "# and repeats it every 5 s until the step ends; each worker acts on the first one it records.",
        'step_pid=""',
        'usr1_pending=""',
        f'ready="$VERL_HPC_LOG_DIR/{READY_MARKER}"',
        f'rm -f "$VERL_HPC_LOG_DIR/{READY_PREFIX}"*  # markers of this job\'s earlier attempts',
        "all_ready() {",
        '  set -- "$ready"*',
        f'  [ -e "$1" ] && [ "$#" -ge {plan.world_size} ]',
        "}",
        "forward() {",
        '  echo "verl-hpc: batch shell got SIG$1 at $(date \'+%F %T\'); passing it to the job step" >&2',
        '  if [ "$1" = USR1 ]; then usr1_pending=1; fi',
        '  if [ -z "$step_pid" ]; then return 0; fi',
        '  if [ "$1" = TERM ]; then',
        '    scancel --signal=TERM "${SLURM_JOB_ID:-}" 2>/dev/null || true',
        "  elif all_ready; then",
        '    kill -s "$1" "$step_pid" 2>/dev/null || true',
        "  fi",
        "}",
        "trap 'forward USR1' USR1",
        "trap 'forward TERM' TERM",
    ]


def _step(plan: ProcessPlan, in_image: bool, requeue_for_image: list[str], env_step: bool) -> list[str]:
    count = len(plan.groups)
    if count > 1 or env_step:  # a hetjob (the env component makes one): name the training components
        which = f"all {count} components" if not env_step else \
            "the training component" if count == 1 else f"the {count} training components"
        comment = f"# One job step over {which}: {plan.world_size} tasks, one process group."
        srun = f"srun --het-group={'0' if count == 1 else f'0-{count - 1}'} --kill-on-bad-exit=0"
    else:
        comment = f"# One job step: {plan.world_size} tasks, one process group."
        srun = "srun --kill-on-bad-exit=0"
    if in_image:
        srun += ' "${in_image[@]}"'
    host_python = "$VERL_HPC_HOST_PYTHON" if in_image else "$VERL_HPC_PYTHON"
    return [
        comment,
        "# In the background, because bash runs a trap only once the foreground command is done.",
        "# Not --kill-on-bad-exit: when a task dies, the others find out in their next collective and",
        "# fail within resources.timeout_seconds naming the rank that stopped (srun would SIGKILL them",
        "# first, and its message numbers tasks per component, which names nobody).",
        f'{srun} bash -c \'trap "" USR1 USR2; : >"$VERL_HPC_LOG_DIR/{READY_MARKER}${{SLURM_PROCID:-0}}"; '
        f'exec "$@"\' worker "$VERL_HPC_PYTHON" -m {WORKER_MODULE} &',
        "step_pid=$!",
        "# `wait` returns early whenever a trapped signal arrives: wait again while the step runs.",
        'while kill -0 "$step_pid" 2>/dev/null; do',
        '  if [ -n "$usr1_pending" ]; then',
        '    sleep 5 & wait $! || true',
        '    if all_ready; then kill -s USR1 "$step_pid" 2>/dev/null || true; fi',
        "  else",
        '    wait "$step_pid" || true',
        "  fi",
        "done",
        "set +e",
        'wait "$step_pid"  # bash keeps the status of a reaped child: this is the step\'s exit status',
        "status=$?",
        'echo "verl-hpc: job step exited with status $status at $(date \'+%F %T\')"',
        *(['kill "$env_pid" 2>/dev/null  # training is over: stop the environment workers',
           'wait "$env_pid" 2>/dev/null'] if env_step else []),
        "# On failure: the ranks' roles, and the first rank the survivors named (from their logs).",
        'if [ "$status" != 0 ]; then',
        f'  echo "verl-hpc: global ranks: {rank_map(plan)}"',
        '  grep -h -m1 -o "suspect: .*" "$VERL_HPC_LOG_DIR"/*.out 2>/dev/null | head -n 1 | sed "s/^/verl-hpc: /" || true',
        "fi",
        *requeue_for_image,
        "# `verl-hpc resize` stopped the run at a step boundary, after a checkpoint: a Slurm job cannot",
        "# change its shape, so submit the resized job (same run directory; it resumes) and end this one.",
        'if [ "$status" = 0 ] && [ -f "$VERL_HPC_RUN_DIR/resize_accepted.yaml" ]; then',
        f'  "{host_python}" -m verl_hpc resubmit "$VERL_HPC_RUN_DIR" --python "{host_python}" || status=$?',
        "fi",
        'exit "$status"',
    ]


def rank_map(plan: ProcessPlan) -> str:
    """'0-1 trainer (actor, ref); 2 rollout (rollout)': which global ranks run which roles."""
    parts, start = [], 0
    for group in plan.groups:
        end = start + group.size - 1
        span = str(start) if end == start else f"{start}-{end}"
        parts.append(f"{span} {group.name} ({', '.join(group.roles)})")
        start = end + 1
    return "; ".join(parts)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _dq(text: str) -> str:
    """`text` escaped for the inside of a double-quoted shell word (no expansion happens)."""
    if "\n" in text or "\r" in text:
        raise ValueError(f"a path with a line break cannot go into a job script: {text!r}")
    return re.sub(r'(["\\$`])', r"\\\1", text)


def _sbatch_value(field: str, value: str) -> str:
    """A value for an #SBATCH line: sbatch splits those on whitespace, so none is allowed."""
    if not _SBATCH_VALUE.match(value):
        raise ConfigError(field, f"{value!r} cannot go into an #SBATCH line",
                          "use no spaces, quotes or backslashes")
    return value
