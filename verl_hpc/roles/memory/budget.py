"""How much memory a process can count on: host RAM on a CPU, the CUDA allocator's on a GPU.

Why three host limits and the smallest of them: a process dies at whichever it reaches
first. `MemAvailable` is what the kernel can give without swapping; a cgroup (a Slurm job's
`--mem`, a container) kills the job at its limit whatever the host has free; `RLIMIT_AS`
(`ulimit -v`) fails any allocation that would take the address space past it, and the
address space of a torch process is several GB larger than its resident set, so what is
left of it is the limit minus the current *virtual* size. Each is turned into "the resident
size this process may reach": what it holds now plus the room left. The parsers take file
text and numbers, so they are tested without the files.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import psutil

UNLIMITED = 1 << 62  # cgroup v1 writes ~2^63 for "no limit"


@dataclass(frozen=True)
class Budget:
    """The resident size a process may reach, and which limit set it."""

    bytes: int
    source: str  # "MemAvailable", "cgroup", "RLIMIT_AS", "cuda", "model.memory_budget_gb"

    def share(self, processes: int) -> Budget:
        """One of `processes` processes on the same memory (a node's ranks, a GPU's tenants)."""
        if processes <= 1:
            return self
        return Budget(self.bytes // processes, f"{self.source} / {processes} processes")


def meminfo_available(text: str) -> int | None:
    """`MemAvailable` from /proc/meminfo text, in bytes."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_room(limit_text: str, usage_text: str, stat_text: str = "") -> int | None:
    """Bytes a cgroup can still grow by: its limit minus its usage (less reclaimable file pages); None if unlimited.

    Works for v2 (`memory.max`, `memory.current`, `inactive_file`) and v1
    (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `total_inactive_file`).
    """
    limit = limit_text.strip()
    if not limit or limit == "max" or int(limit) >= UNLIMITED:
        return None
    usage = int(usage_text.strip() or 0)
    reclaimable = 0
    for line in stat_text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file"):
            reclaimable = int(value)
            break
    return max(0, int(limit) - max(0, usage - reclaimable))


def _cgroup_paths(proc_cgroup: str) -> list[tuple[Path, str, str, str]]:
    """Candidate (dir, limit file, usage file, stat file) for this process's memory cgroup, v2 then v1."""
    out: list[tuple[Path, str, str, str]] = []
    root = Path("/sys/fs/cgroup")
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out += [(root / path.lstrip("/"), "memory.max", "memory.current", "memory.stat"),
                    (root, "memory.max", "memory.current", "memory.stat")]
        elif "memory" in controllers.split(","):
            out += [(root / "memory" / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "memory.stat"), (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat")]
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_cgroup_room() -> int | None:
    """The room left in this process's memory cgroup (v2 or v1), None when it has no limit."""
    proc = _read(Path("/proc/self/cgroup"))
    if proc is None:
        return None
    for folder, limit_name, usage_name, stat_name in _cgroup_paths(proc):
        limit, usage = _read(folder / limit_name), _read(folder / usage_name)
        if limit is not None and usage is not None:
            return cgroup_room(limit, usage, _read(folder / stat_name) or "")
    return None


def address_space_room(limit: int, virtual_size: int) -> int | None:
    """Bytes the address space may still grow by under RLIMIT_AS (`limit`), None when unlimited."""
    if limit in (resource.RLIM_INFINITY, -1) or limit >= UNLIMITED:
        return None
    return max(0, limit - virtual_size)


def host_budget(rss: int | None = None) -> Budget:
    """The resident size this process may reach on its host: the smallest of the three limits."""
    process = psutil.Process()
    info = process.memory_info()
    rss = info.rss if rss is None else rss
    candidates: list[tuple[int, str]] = []
    available = meminfo_available(_read(Path("/proc/meminfo")) or "")
    if available is None:
        available = int(psutil.virtual_memory().available)
    candidates.append((rss + available, "MemAvailable"))
    room = read_cgroup_room()
    if room is not None:
        candidates.append((rss + room, "cgroup"))
    space = address_space_room(resource.getrlimit(resource.RLIMIT_AS)[0], info.vms)
    if space is not None:
        candidates.append((rss + space, "RLIMIT_AS"))
    size, source = min(candidates)
    return Budget(size, source)


def cuda_budget(device_index: int) -> Budget:
    """What the CUDA allocator can hand out on the device: free memory plus what it holds unused."""
    import torch

    free, _total = torch.cuda.mem_get_info(device_index)
    held = torch.cuda.memory_reserved(device_index) - torch.cuda.memory_allocated(device_index)
    return Budget(int(free + held + torch.cuda.memory_allocated(device_index)), "cuda")


def device_budget(device_type: str, device_index: int = 0, override_gb: float | None = None) -> Budget:
    """This process's budget on its device (`model.memory_budget_gb` wins when set)."""
    if override_gb is not None:
        return Budget(int(override_gb * (1 << 30)), "model.memory_budget_gb")
    if device_type == "cuda":
        return cuda_budget(device_index)
    return host_budget()


def runtime_floor() -> int:
    """The resident set this process has now (interpreter, torch, libraries; no model yet)."""
    return int(psutil.Process().memory_info().rss) if os.path.exists("/proc/self") else 0
