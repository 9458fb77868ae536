"""Who am I in the job: rank, world, rendezvous address, read from whoever launched us.

Why one object for three launchers: our local launcher, torchrun and Slurm's srun each
describe a task with different variables (and a Slurm heterogeneous step describes it
only piecewise, per component). Everything downstream (process groups, log file names,
device pinning, checkpoint ownership) reads `JobEnvironment` and never the raw variables,
so a new launcher means one new branch here rather than edits everywhere.

Precedence (first match wins): our launcher (`VERL_HPC_RANK`), torchrun (`RANK` +
`WORLD_SIZE`), Slurm (`SLURM_PROCID`), else a single process. Ours comes first because
the local launcher may itself run inside a Slurm allocation, where `SLURM_*` describe the
allocation rather than our processes; torchrun before Slurm for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from verl_hpc.runtime.process.hostlist import hostnames, parse_tasks_per_node

Scheduler = Literal["local", "slurm", "torchrun"]

PORT_SPAN = 20000  # ports derived from a job id: [base, base + PORT_SPAN), two jobs on a node rarely collide
SLURM_PORT_BASE = 29500  # torchrun's default MASTER_PORT; a Slurm job's port is this + job id % PORT_SPAN
DEBUG_PREFIXES = ("VERL_HPC_", "SLURM_", "MASTER_", "NCCL_", "GLOO_", "TORCHELASTIC_")
DEBUG_NAMES = ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_PORT_DRAW = random.SystemRandom()  # os.urandom per draw: forked or seeded processes still draw apart


def port_from_job_id(job_id: str | None, base: int) -> int:
    """The same port on every task of a job, different for most jobs sharing a node.

    Why deterministic: tasks on different nodes must agree without talking first, and a
    requeued job (same id) comes back to the same port its config and logs mention.
    """
    if not job_id:
        return base
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return base + number % PORT_SPAN


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now, drawn at random below the kernel's ephemeral range.

    Why not `bind(0)`: the kernel also hands its ephemeral ports to outgoing connections
    (gloo pairs, Flight, HTTP clients), so a port it called free was soon someone's source port
    (CI: EADDRINUSE at rendezvous). Below that range only listeners compete; still racy.
    """
    top = _ephemeral_start()
    for _ in range(64):
        port = _PORT_DRAW.randrange(max(1024, top - 12000), top)
        if SLURM_PORT_BASE <= port < SLURM_PORT_BASE + 1000:  # where the first Slurm jobs' ports fall
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, contextlib.suppress(OSError):
            sock.bind((host, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range: let the kernel pick
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise ValueError(f"environment variable {name} is required but not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _het(env: Mapping[str, str], base: str, group: int) -> str | None:
    """A per-component variable; Slurm < 20.02 spelled `_HET_GROUP_` as `_PACK_GROUP_`."""
    return env.get(f"{base}_HET_GROUP_{group}") or env.get(f"{base}_PACK_GROUP_{group}")


def het_group_sizes(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Tasks per hetjob component of this step, or None outside a step spanning all of them.

    Why check the step: the batch script of a hetjob exports every component's counts, so a
    plain `srun` there (component 0 only) inherits them. Slurm 22.05 sets
    SLURM_STEP_NUM_TASKS in every srun task (measured): when it disagrees with the sum,
    this step is not the het step and its own world is what counts.
    """
    size_name = "SLURM_HET_SIZE" if env.get("SLURM_HET_SIZE") else "SLURM_PACK_SIZE"
    if not env.get(size_name):
        return None
    size = _int(env, size_name)
    sizes = []
    for k in range(size):
        value = _het(env, "SLURM_NTASKS", k)
        if value is None:
            raise ValueError(f"SLURM_HET_SIZE={size} but SLURM_NTASKS_HET_GROUP_{k} is not set; "
                             "run the step over all components (srun --het-group=0-N)")
        sizes.append(int(value))
    step_tasks = env.get("SLURM_STEP_NUM_TASKS")
    if step_tasks and step_tasks.isdigit() and int(step_tasks) != sum(sizes):
        return _step_prefix(sizes, int(step_tasks))
    return tuple(sizes)


def _step_prefix(sizes: list[int], step_tasks: int) -> tuple[int, ...] | None:
    """The first components, when this step spans exactly them (`srun --het-group=0-K`): training
    steps leave out the environment workers' component, which is last (measured, Slurm 22.05:
    SLURM_HET_SIZE still counts every component there). None for any other step."""
    total = 0
    for count, size in enumerate(sizes, start=1):
        total += size
        if total == step_tasks:
            return tuple(sizes[:count])
    return None


def _component_of(rank: int, sizes: tuple[int, ...]) -> tuple[int, int]:
    start = 0
    for index, size in enumerate(sizes):
        if rank < start + size:
            return index, rank - start
        start += size
    raise ValueError(f"SLURM_PROCID={rank} is beyond the {start} tasks of the hetjob components {sizes}")


def _slurm_local_world(env: Mapping[str, str], local_rank: int) -> int:
    """Tasks on this node, best effort: Slurm reports a compressed per-node list.

    Why the step's list first: in a het step SLURM_STEP_TASKS_PER_NODE covers every
    component's nodes and SLURM_NODEID indexes it (measured: `2,1(x2)`, node ids 0,0,1,2),
    while the `_HET_GROUP_k` lists are per component. Best effort because the value only
    picks devices and sizes thread pools; collectives never depend on it.
    """
    fallback = local_rank + 1
    node = env.get("SLURM_NODEID", "")
    try:
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            spec = env.get(name)
            if not spec:
                continue
            counts = parse_tasks_per_node(spec)
            if node.isdigit() and int(node) < len(counts):
                return max(counts[int(node)], fallback)
            if len(set(counts)) == 1:
                return max(counts[0], fallback)
        return fallback
    except ValueError:
        return fallback


def _debug_variables(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    keep = {k: v for k, v in env.items() if k.startswith(DEBUG_PREFIXES) or k in DEBUG_NAMES}
    return tuple(sorted(keep.items()))


@dataclass(frozen=True)
class JobEnvironment:
    """This task's place in the job, independent of the launcher that started it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job_id: str | None
    restart_count: int
    scheduler: Scheduler
    hostname: str
    # Tasks per Slurm hetjob component, in component order; None outside a hetjob.
    het_group_sizes: tuple[int, ...] | None = None
    # The launcher variables this was derived from, for write_debug_file (not compared).
    variables: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size} (from {self.scheduler})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size} "
                             f"processes (from {self.scheduler})")
        if self.local_rank < 0 or self.local_world_size < 1:
            raise ValueError(f"bad local rank {self.local_rank} / local world {self.local_world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master port {self.master_port} is not a valid TCP port")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 default_port_base: int = SLURM_PORT_BASE) -> JobEnvironment:
        """Read the launcher's variables (os.environ by default); see the module docstring."""
        env = os.environ if environ is None else environ
        if "VERL_HPC_RANK" in env:
            return cls._from_local(env, default_port_base)
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls._from_torchrun(env, default_port_base)
        if "SLURM_PROCID" in env:
            return cls._from_slurm(env, default_port_base)
        return cls._single(env)

    @classmethod
    def _from_local(cls, env: Mapping[str, str], base: int) -> JobEnvironment:
        world = _int(env, "VERL_HPC_WORLD_SIZE")
        return cls(rank=_int(env, "VERL_HPC_RANK"), world_size=world,
                   local_rank=_int(env, "VERL_HPC_LOCAL_RANK", _int(env, "VERL_HPC_RANK")),
                   local_world_size=_int(env, "VERL_HPC_LOCAL_WORLD_SIZE", world),
                   master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                   master_port=_int(env, "MASTER_PORT", base),
                   job_id=env.get("VERL_HPC_JOB_ID") or None,
                   restart_count=_int(env, "VERL_HPC_RESTART_COUNT", 0), scheduler="local",
                   hostname=socket.gethostname(), variables=_debug_variables(env))

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str], base: int) -> JobEnvironment:
        world = _int(env, "WORLD_SIZE")
        return cls(rank=_int(env, "RANK"), world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
                   local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
                   master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                   master_port=_int(env, "MASTER_PORT", base),
                   job_id=env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or None,
                   restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0), scheduler="torchrun",
                   hostname=socket.gethostname(), variables=_debug_variables(env))

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str], base: int) -> JobEnvironment:
        """Slurm task: in a heterogeneous step the world spans every component.

        Why sum the components: outside the het step itself `SLURM_NTASKS` counts only one
        component, while `SLURM_PROCID` is global; ranks are contiguous per component in
        component order, matching ProcessPlan's rank layout.
        """
        rank = _int(env, "SLURM_PROCID")
        sizes = het_group_sizes(env)
        tasks = _int(env, "SLURM_NTASKS", _int(env, "SLURM_NPROCS", 1))
        world = sum(sizes) if sizes else _int(env, "SLURM_STEP_NUM_TASKS", tasks)
        local_rank = _int(env, "SLURM_LOCALID", 0)
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None
        return cls(rank=rank, world_size=world, local_rank=local_rank,
                   local_world_size=_slurm_local_world(env, local_rank),
                   master_addr=env.get("MASTER_ADDR") or _slurm_master(env, het=sizes is not None),
                   master_port=_int(env, "MASTER_PORT", port_from_job_id(job_id, base)),
                   job_id=job_id, restart_count=_int(env, "SLURM_RESTART_COUNT", 0), scheduler="slurm",
                   hostname=socket.gethostname(), het_group_sizes=sizes, variables=_debug_variables(env))

    @classmethod
    def _single(cls, env: Mapping[str, str]) -> JobEnvironment:
        """No launcher: a world of one; any free port, since nobody else must agree on it."""
        addr = env.get("MASTER_ADDR") or "127.0.0.1"
        port = _int(env, "MASTER_PORT", 0) or free_port()
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=addr,
                   master_port=port, job_id=None, restart_count=0, scheduler="local",
                   hostname=socket.gethostname(), variables=_debug_variables(env))

    def het_component(self) -> tuple[int, int] | None:
        """(hetjob component index, rank within it), or None outside a Slurm hetjob.

        Why derived: Slurm sets no variable naming a task's own component; it follows from
        the global rank and the running sums of the components' task counts.
        """
        if self.het_group_sizes is None:
            return None
        return _component_of(self.rank, self.het_group_sizes)

    def to_env(self) -> dict[str, str]:
        """The variables torch.distributed's `env://` rendezvous reads."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    def write_debug_file(self, path: str | Path) -> Path:
        """Write what this task saw and derived, as JSON, mode 0600, atomically.

        Why: "rank 5 hung at init" is answered by comparing these files across tasks
        (wrong port, wrong nodelist, mismatched world). 0600 because NCCL/Slurm variables
        can reveal cluster layout; atomic so a crash never leaves half a file to mislead.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = {k: v for k, v in asdict(self).items() if k != "variables"}
        payload = {"derived": fields, "het_component": self.het_component(),
                   "variables": dict(self.variables), "pid": os.getpid(), "written_at": time.time()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(payload, out, indent=2, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path


def _slurm_master(env: Mapping[str, str], het: bool) -> str:
    """First host of het component 0, else of this step, else of the job: rank 0 runs there."""
    candidates = [_het(env, "SLURM_JOB_NODELIST", 0)] if het else []
    candidates += [env.get("SLURM_STEP_NODELIST"), env.get("SLURM_JOB_NODELIST"), env.get("SLURM_NODELIST")]
    nodelist = next((c for c in candidates if c), None)
    if not nodelist:
        raise ValueError("running under Slurm but SLURM_JOB_NODELIST is not set; set MASTER_ADDR")
    names = hostnames(nodelist)
    if not names:
        raise ValueError(f"Slurm nodelist {nodelist!r} names no host; set MASTER_ADDR")
    return names[0]
