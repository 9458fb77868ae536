"""The job script's container block: every task of every hetjob component runs inside one image.

Why one array in front of the task's command: pyxis takes srun options (`--container-image`,
`--container-mounts`) and Apptainer and podman take a command prefix (`apptainer exec ...
IMAGE`, `podman run ... IMAGE`); both stand right before `bash -c` on the srun line, so the
script builds `in_image=(...)` for the chosen runtime and the step line stays the same for all.
The per-task wrapper (`trap "" USR1 USR2`, the ready marker, `exec`) then runs inside the image,
so a USR1 can never reach a task that has not yet chosen to ignore it.

The run directory is mounted at its own path, read-write: checkpoints, logs, the run secret and
the ready markers are where the job and a requeued job expect them, as without a container. The
files the config names (model, data, a reward file) are mounted read-only at their own paths.

Slurm's commands stay on the host: a worker in the image that wants the job requeued (time limit
or preemption notice, no `scontrol` inside) leaves a request file, and the batch shell requeues.

Rendering is pure (config in, lines out); `image_problem` is the one check that looks at the
machine, called by `verl-hpc submit` before anything is created.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from verl_hpc.config import RunConfig
from verl_hpc.config.checks import expand_path
from verl_hpc.config.container import ContainerConfig, parse_mount
from verl_hpc.config.container_paths import input_paths

REQUEUE_REQUEST = ".requeue_${SLURM_JOB_ID:-0}_${SLURM_RESTART_COUNT:-0}"
JOB_LABEL = "verl-hpc.job"
# Nor is scontrol there for the workers' deadline (runtime/process/endtime.py): the batch shell reads
# this attempt's earliest EndTime (one per hetjob component) and passes it in as unix seconds.
END_TIME_LINES = [
    "# No scontrol in the image either: this attempt's end time, for the workers' deadline.",
    'if [ "$VERL_HPC_CONTAINER_RUNTIME" != none ] && [ -z "${SLURM_JOB_END_TIME:-}" ]; then',
    '  VERL_HPC_END_TIME=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | grep -o "EndTime=[0-9][0-9T:-]*" \\',
    '    | cut -d= -f2 | xargs -r -n1 date +%s -d 2>/dev/null | sort -n | head -n 1) || VERL_HPC_END_TIME=""',
    '  if [ -n "$VERL_HPC_END_TIME" ]; then export VERL_HPC_END_TIME; else unset VERL_HPC_END_TIME; fi',
    "fi",
]


def uses_container(cfg: RunConfig) -> bool:
    return cfg.slurm.container.runtime != "none"


def default_mounts(cfg: RunConfig, template: bool) -> list[str]:
    """`SRC:DST[:ro]` for the config's input paths (read-only, same path) and `slurm.container.mounts`.

    In a template (`template=True`) `~` becomes `$HOME`, expanded when the job runs on the
    cluster, and relative paths are left out (a template cannot know the submission directory).
    """
    found: list[str] = []
    for _field, path in input_paths(cfg):
        if template:
            if path.startswith("~/"):
                found.append(f"$HOME/{path[2:]}:$HOME/{path[2:]}:ro")
            elif path.startswith(("/", "$")):
                found.append(f"{path}:{path}:ro")
            continue
        resolved = str(expand_path(path).absolute())
        found.append(f"{resolved}:{resolved}:ro")
    for index, mount in enumerate(cfg.slurm.container.mounts):
        source, target, read_only = parse_mount(mount, f"slurm.container.mounts[{index}]")
        found.append(f"{source}:{target}:ro" if read_only else f"{source}:{target}")
    return list(dict.fromkeys(found))


def container_block(cfg: RunConfig, template: bool) -> list[str]:
    """The script lines that choose the runtime and build `in_image`; empty without a container.

    A rendered script gets them only when `slurm.container.runtime` is set; a template always,
    defaulting to the config's runtime (none for a plain config), switchable when submitting.
    """
    container = cfg.slurm.container
    if not template and not uses_container(cfg):
        return []
    mounts = ",".join(default_mounts(cfg, template))
    nv = " --nv" if any_cuda(cfg) else ""
    gpus = " --device nvidia.com/gpu=all" if any_cuda(cfg) else ""
    image = _dq(container.image or "")
    env_lines = [f'export {name}="{_dq(str(value))}"' for name, value in sorted(container.env.items())]
    return [
        "# ---- slurm.container: every task runs inside an image (docs/container.md) ----",
        "# The runtime (pyxis, apptainer or podman; none: on the host), the image, and mounts (SRC:DST[:ro],",
        "# comma-separated) besides the run directory, which is mounted at its own path so checkpoints,",
        "# logs and requeue work as without a container. Set any of them in the environment of `sbatch`.",
        f'VERL_HPC_CONTAINER_RUNTIME="${{VERL_HPC_CONTAINER_RUNTIME:-{container.runtime}}}"',
        f'VERL_HPC_CONTAINER_IMAGE="${{VERL_HPC_CONTAINER_IMAGE:-{image}}}"',
        f'VERL_HPC_CONTAINER_MOUNTS="${{VERL_HPC_CONTAINER_MOUNTS-{_dq(mounts, keep_vars=template)}}}"',
        "# The interpreter inside the image; the host's ($VERL_HPC_PYTHON) still runs `verl-hpc resubmit`.",
        f'VERL_HPC_IMAGE_PYTHON="${{VERL_HPC_IMAGE_PYTHON:-{_dq(container.python)}}}"',
        *env_lines,
        'VERL_HPC_HOST_PYTHON="$VERL_HPC_PYTHON"',
        'mounts="$VERL_HPC_RUN_DIR:$VERL_HPC_RUN_DIR${VERL_HPC_CONTAINER_MOUNTS:+,$VERL_HPC_CONTAINER_MOUNTS}"',
        'case "$VERL_HPC_CONTAINER_RUNTIME" in',
        "  none) in_image=() ;;",
        "  pyxis)  # srun options of the pyxis plugin (enroot): the task itself starts inside the image",
        '    in_image=(--container-image="$VERL_HPC_CONTAINER_IMAGE" --container-mounts="$mounts"',
        '              --container-workdir="$VERL_HPC_RUN_DIR") ;;',
        "  apptainer)",
        f'    in_image=(apptainer exec{nv} --bind "$mounts" --pwd "$VERL_HPC_RUN_DIR" "$VERL_HPC_CONTAINER_IMAGE") ;;',
        "  podman)  # one machine (tools/slurm-local): the host's network, IPC (/dev/shm) and process ids",
        "    in_image=(podman run --rm --log-driver=passthrough --network=host --ipc=host --pid=host --env-host",
        f'              --security-opt=label=disable --label "{JOB_LABEL}=${{SLURM_JOB_ID:-0}}" -w "$VERL_HPC_RUN_DIR"{gpus})',
        '    IFS=, read -ra each_mount <<<"$mounts"',
        '    for mount in "${each_mount[@]}"; do in_image+=(-v "$mount"); done',
        '    in_image+=("$VERL_HPC_CONTAINER_IMAGE")',
        "    # A podman client killed after KillWait leaves its container running: an earlier attempt's go first.",
        f'    podman ps -aq --filter "label={JOB_LABEL}=${{SLURM_JOB_ID:-0}}" | xargs -r podman rm -f -t 0 >/dev/null || true ;;',
        '  *) echo "verl-hpc: VERL_HPC_CONTAINER_RUNTIME=$VERL_HPC_CONTAINER_RUNTIME: use none, pyxis, apptainer or podman" >&2',
        "     exit 2 ;;",
        "esac",
        'if [ "$VERL_HPC_CONTAINER_RUNTIME" != none ]; then VERL_HPC_PYTHON="$VERL_HPC_IMAGE_PYTHON"; fi',
        "# Slurm's commands stay on the host: a worker in the image asks for a requeue with this file.",
        f'export VERL_HPC_REQUEUE_REQUEST="$VERL_HPC_LOG_DIR/{REQUEUE_REQUEST}"',
        'rm -f "$VERL_HPC_REQUEUE_REQUEST"',
        *END_TIME_LINES,
    ]


def after_step(cfg: RunConfig, template: bool) -> list[str]:
    """After the step: the requeue a worker in the image asked for (it has no scontrol)."""
    if not template and not uses_container(cfg):
        return []
    return [
        "# A worker in the image asked for the requeue (time limit or preemption notice): do it here.",
        'if [ -f "$VERL_HPC_REQUEUE_REQUEST" ]; then',
        '  echo "verl-hpc: requeueing job ${SLURM_JOB_ID:-} for the workers in the image"',
        '  scontrol requeue "${SLURM_JOB_ID:-}" || status=$?',
        "fi",
    ]


def any_cuda(cfg: RunConfig) -> bool:
    from verl_hpc.config.placement import plan_for_config

    return any(group.resources.device_type == "cuda" for group in plan_for_config(cfg).groups)


def image_problem(container: ContainerConfig) -> str | None:
    """Why the image cannot be used from this machine, in one line; None when it can (or cannot be told).

    A .sif/.sqsh file must exist (the same path is used on the compute nodes); a podman image
    must be in this machine's store. A registry image (pyxis) or a URI (apptainer) is pulled on
    the nodes and is not checked here.
    """
    image = container.image or ""
    if container.runtime == "none":
        return None
    if container.runtime == "podman":
        podman = shutil.which("podman")
        if podman is None:
            return "slurm.container.runtime is podman but podman is not installed here (apt-get install podman)"
        done = subprocess.run([podman, "image", "exists", image], capture_output=True, text=True, timeout=60,
                              check=False)
        if done.returncode != 0:
            return (f"slurm.container.image: {image} is not in podman's local store: build it with "
                    "tools/build-image.sh (podman images lists what is there)")
        return None
    if image.startswith("/") and not Path(image).exists():
        how = "tools/build-image.sh --sif FILE" if container.runtime == "apptainer" else "enroot import"
        return f"slurm.container.image: {image} does not exist: make it with {how} (docs/container.md)"
    return None


def _dq(text: str, keep_vars: bool = False) -> str:
    """`text` for the inside of a double-quoted shell word; `$VARS` expand there with `keep_vars`."""
    if "\n" in text or "\r" in text:
        raise ValueError(f"a value with a line break cannot go into a job script: {text!r}")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return escaped if keep_vars else escaped.replace("$", "\\$")
