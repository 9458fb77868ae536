"""Per-role resources: where each role of the RL loop runs, locally or under Slurm.

Why its own module: `resource_config.yaml` also ships as a standalone file, and
the same shape is the `resources:` section of a full run config, so one typed object
serves both (`load_resource_config` reads the standalone file verbatim).

Placement rules live here because they are facts about devices, not about training:
a vLLM engine claims most of a GPU's memory, so no other role may share its devices
unless it is the actor in `colocated` placement (the hybrid engine time-shares them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from verl_hpc.config.base import StrictModel
from verl_hpc.config.errors import FieldError

ROLE_NAMES = ("actor", "critic", "ref", "reward", "rollout")
Strategy = Literal["fsdp", "vllm", "hf", "none", "data_parallel"]

# Which strategies make sense for which role (the error names the valid ones).
VALID_STRATEGIES: dict[str, tuple[str, ...]] = {
    "actor": ("fsdp", "hf"),
    "critic": ("fsdp", "hf"),
    "ref": ("fsdp", "hf", "none"),
    "reward": ("none", "hf", "data_parallel"),
    "rollout": ("hf", "vllm"),
}


class VllmArgs(StrictModel):
    """vLLM's engine arguments as `resource_config.yaml` writes them, plus the knobs a CPU engine needs set explicitly."""

    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    enforce_eager: bool = False
    max_model_len: int | None = Field(None, ge=1)
    dtype: str = "auto"
    seed: int = 0
    kv_cache_space_gb: float | None = Field(None, gt=0.0)
    enable_sleep_mode: bool = False


class RoleResources(StrictModel):
    """Devices and scheduler request for one role."""

    device_type: Literal["cuda", "cpu"] = "cpu"
    device_ids: list[int] = Field(default_factory=lambda: [0])
    strategy: Strategy = "hf"
    vllm_args: VllmArgs | None = None
    # Slurm request for this role's hetjob component (ignored by `verl-hpc train`).
    nodes: int = Field(1, ge=1)
    tasks_per_node: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    mem: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None

    @field_validator("device_ids")
    @classmethod
    def _ids_valid(cls, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("must list at least one device id (e.g. [0])")
        if any(i < 0 for i in ids):
            raise ValueError(f"device ids must be >= 0, got {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"device ids must be distinct, got {ids}")
        return ids

    @property
    def world_size(self) -> int:
        """Processes this role runs as: `nodes` x tasks per node (default: one per device slot).

        Why nodes count: under Slurm a role's hetjob component starts `--nodes` x
        `--ntasks-per-node` tasks, and the process plan, the local launcher and the sbatch
        script must agree on that number. `verl-hpc train` refuses `nodes > 1`, so locally
        this is the tasks per node, i.e. one process per device slot unless told otherwise.
        """
        return self.nodes * (self.tasks_per_node or len(self.device_ids) // self.devices_per_process)

    @property
    def devices_per_process(self) -> int:
        """Device slots one process drives: the tensor-parallel size of a vLLM engine, else 1."""
        if self.strategy == "vllm" and self.vllm_args is not None:
            return self.vllm_args.tensor_parallel_size
        return 1


class EnvResources(StrictModel):
    """Environment worker processes (`rollout.multi_turn.environment`) as a role of their own.

    Locally the rollout starts `num_workers` processes beside itself; under Slurm they are a
    hetjob component on CPU nodes (no GPUs requested), one task per worker, started with the job
    and requeued with it (verl_hpc/roles/env/remote.py)."""

    num_workers: int = Field(1, ge=1, description="environment worker processes (tasks under Slurm); each "
                             "holds many episodes at once")
    cpus_per_worker: int = Field(1, ge=1, description="CPUs of each worker (Slurm --cpus-per-task)")
    nodes: int = Field(1, ge=1, description="nodes of the env component under Slurm; num_workers must be a "
                       "multiple of it")
    mem: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None

    @model_validator(mode="after")
    def _spread(self) -> EnvResources:
        if self.num_workers % self.nodes:
            raise FieldError("num_workers", f"{self.num_workers} workers cannot be spread evenly over "
                             f"{self.nodes} nodes", f"use a multiple of {self.nodes}, or change resources.env.nodes")
        return self

    @property
    def workers_per_node(self) -> int:
        return self.num_workers // self.nodes


def _on_device(role: RoleResources | dict[str, Any] | None, kind: str) -> RoleResources | dict[str, Any]:
    """One role's (raw or validated) resources moved to `kind`; on CPU without sleep mode."""
    if isinstance(role, RoleResources):  # validate_assignment passes the validated fields
        args = role.vllm_args
        if kind == "cpu" and args is not None:
            args = args.model_copy(update={"enable_sleep_mode": False})
        return role.model_copy(update={"device_type": kind, "vllm_args": args})
    role = dict(role or {})
    role["device_type"] = kind
    if kind == "cpu" and isinstance(role.get("vllm_args"), dict):
        role["vllm_args"] = {k: v for k, v in role["vllm_args"].items() if k != "enable_sleep_mode"}
    return role


class ResourceConfig(StrictModel):
    """All roles' resources plus the communication settings shared by the whole world."""

    # One word to move a whole config between device kinds (a cluster config on a laptop):
    # see `_apply_device_type`. None = each role's own `device_type`.
    device_type: Literal["cuda", "cpu"] | None = Field(None, description=(
        "every role's `device_type` at once, winning over each role's own (`resources.device_type=cpu` runs a "
        "CUDA config on CPU: `nccl` becomes `auto` (gloo), `enable_sleep_mode` and GPU-only model dtypes are "
        "dropped); unset = per role"))
    actor: RoleResources = Field(default_factory=lambda: RoleResources(strategy="hf"))
    critic: RoleResources | None = None
    ref: RoleResources | None = None
    reward: RoleResources | None = None
    rollout: RoleResources = Field(default_factory=lambda: RoleResources(strategy="hf"))
    env: EnvResources | None = Field(None, description="environment workers as a role of their own: processes "
                                     "beside the rollout locally, a CPU-only hetjob component under Slurm")
    placement: Literal["colocated", "split"] = "colocated"
    comm_backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_seconds: float = Field(180.0, gt=0.0)
    # NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_*, NCCL_DEBUG, ...: set in every worker
    # before the process group starts (and recorded in its env_*.json), locally and under Slurm.
    comm_env: dict[str, str] = Field(default_factory=dict)
    host_allocator: Literal["auto", "glibc", "tcmalloc"] = Field("auto", description=(
        "malloc of the run's processes: `auto` preloads TCMalloc (libtcmalloc-minimal4) into every process "
        "on the CPU when the library is installed (a lower, steadier host peak: docs/memory.md), `glibc` "
        "never, `tcmalloc` always (an error where it is missing); an allocator already in LD_PRELOAD is kept"))

    @model_validator(mode="before")
    @classmethod
    def _apply_device_type(cls, data: Any) -> Any:
        """`device_type: X` sets every role's device type to X; on CPU, GPU-only settings go.

        Why before validation: a CUDA config moved to CPU must not then fail on what only
        makes sense on GPUs (sleep mode, an explicit nccl backend); the roles that run
        anyway (actor, rollout) get it even when absent, the optional ones only when set.
        """
        if not isinstance(data, dict) or data.get("device_type") is None:
            return data
        kind, data = data["device_type"], dict(data)
        for name in ROLE_NAMES:
            role = data.get(name)
            if role is not None or name in ("actor", "rollout"):
                data[name] = _on_device(role, kind)
        if kind == "cpu" and data.get("comm_backend") == "nccl":
            data["comm_backend"] = "auto"
        return data

    @field_validator("comm_env")
    @classmethod
    def _comm_env_names(cls, env: dict[str, str]) -> dict[str, str]:
        allowed = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "MASTER_ADDR", "TP_SOCKET_IFNAME")
        bad = [k for k in env if not k.startswith(allowed)]
        if bad:
            raise ValueError(f"{bad} are not communication variables (allowed prefixes: {', '.join(allowed)})")
        return {k: str(v) for k, v in env.items()}

    @model_validator(mode="after")
    def _check_roles(self) -> ResourceConfig:
        for name in ROLE_NAMES:
            role = getattr(self, name)
            if role is None:
                continue
            valid = VALID_STRATEGIES[name]
            if role.strategy not in valid:
                raise FieldError(f"{name}.strategy", f"{role.strategy!r} is not valid for the {name} role",
                                 f"use one of {', '.join(valid)}")
            if role.vllm_args is not None and role.strategy != "vllm":
                raise FieldError(f"{name}.vllm_args", f"only meaningful with strategy: vllm (this role "
                                 f"has strategy: {role.strategy})", "remove vllm_args or set strategy: vllm")
            self._check_vllm(name, role)
        self._check_overlaps()
        return self

    @staticmethod
    def _check_vllm(name: str, role: RoleResources) -> None:
        args = role.vllm_args
        if args is None:
            return
        tp = args.tensor_parallel_size
        if len(role.device_ids) % tp:
            raise FieldError(f"{name}.vllm_args.tensor_parallel_size", f"{tp} does not divide the "
                             f"{len(role.device_ids)} device_ids {role.device_ids}: each engine takes {tp} of them",
                             f"list a multiple of {tp} device ids, or change tensor_parallel_size")
        if args.enable_sleep_mode and role.device_type != "cuda":
            raise FieldError(f"{name}.vllm_args.enable_sleep_mode", "vLLM sleep mode frees GPU memory; "
                             "there is none to free on CPU", "remove enable_sleep_mode, or use device_type: cuda")

    def _check_overlaps(self) -> None:
        """A vLLM role owns its GPUs; only the colocated actor may time-share them."""
        for name in ROLE_NAMES:
            role = getattr(self, name)
            if role is None or role.strategy != "vllm" or role.device_type != "cuda":
                continue
            for other_name in ROLE_NAMES:
                other = getattr(self, other_name)
                if other_name == name or other is None or other.device_type != "cuda":
                    continue
                if other_name in ("actor", "critic", "ref") and self.placement == "colocated":
                    continue
                shared = sorted(set(role.device_ids) & set(other.device_ids))
                if shared:
                    raise FieldError(
                        f"{other_name}.device_ids", f"GPU(s) {shared} are also used by the vLLM {name} role, "
                        "which reserves their memory",
                        f"give {other_name} other devices" + (" or set placement: colocated"
                                                              if other_name in ("actor", "critic", "ref") else ""))
        if self.placement == "split":
            rollout, actor = self.rollout, self.actor
            if rollout.device_type == actor.device_type == "cuda":
                shared = sorted(set(rollout.device_ids) & set(actor.device_ids))
                if shared:
                    raise FieldError("rollout.device_ids", f"GPU(s) {shared} are also the actor's, but "
                                     "placement is split", "use other devices or placement: colocated")

    def role(self, name: str) -> RoleResources | None:
        if name not in ROLE_NAMES:
            raise KeyError(f"unknown role {name!r}; roles are {', '.join(ROLE_NAMES)}")
        return getattr(self, name)

    def resolved_backend(self) -> str:
        """nccl when any trainer role is on CUDA (unless told otherwise), else gloo."""
        if self.comm_backend != "auto":
            return self.comm_backend
        on_cuda = any(r is not None and r.device_type == "cuda" for r in (self.actor, self.critic, self.ref))
        return "nccl" if on_cuda else "gloo"

