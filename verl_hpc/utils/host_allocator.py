"""The host memory allocator of a run's processes: TCMalloc on the CPU unless the user chose.

Why: a CPU process holds the model, its gradients, AdamW's state and HF's KV cache in host
memory, and glibc's malloc returns freed blocks to the system late and in pieces. With
SmolLM2 at 512 new tokens the same step peaked 5.3-5.5 GB under glibc and 4.3 GB under
TCMalloc, at 0.87-0.95x glibc's step time (docs/memory.md), which is what the memory plan's
estimate assumes. An allocator can only be chosen before the process starts (LD_PRELOAD is
read by the dynamic loader), so the choice is made as the environment of a process about to
exec: `verl-hpc train` re-executes itself once with it before torch is loaded, the local
launcher's workers inherit it, and a Slurm task re-executes itself for its own device
(runtime/worker.py). PyTorch's CPU launcher (`torch.backends.xeon.run_cpu`) and vLLM's CPU
backend preload the same library for the same reason.

Everything that decides is a pure function of its inputs; `reexec` is the one action.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CHOICES = ("auto", "glibc", "tcmalloc")
# Debian/Ubuntu's libtcmalloc-minimal4 first (no heap profiler: nothing to pay for), then the full
# gperftools build, under the multiarch and plain library directories of common distributions.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib/powerpc64le-linux-gnu",
                "/usr/lib64", "/usr/lib", "/usr/local/lib")
# gperftools prints a line for every allocation over 1 GiB by default; a 1.5B model's weights are one.
QUIET_LARGE_ALLOCS = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
# Set by the re-executed process: it must never re-execute again, whatever the loader made of LD_PRELOAD.
APPLIED_ENV = "VERL_HPC_HOST_ALLOCATOR"
INSTALL_HINT = "apt-get install libtcmalloc-minimal4 (dnf: gperftools-libs)"


@dataclass(frozen=True)
class AllocatorChoice:
    """What a process about to start should run with: the variables to add and one line saying why."""

    name: str  # "tcmalloc" or "glibc" (or "preloaded": the user's own LD_PRELOAD names an allocator)
    reason: str
    env: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        return f"host allocator: {self.name} ({self.reason})"


def library_dirs(prefixes: Iterable[str]) -> list[str]:
    """Where to look: the active environment's own lib/ (a conda env ships gperftools there) first."""
    return [*(os.path.join(p, "lib") for p in prefixes if p), *LIBRARY_DIRS]


def find_tcmalloc(dirs: Sequence[str], exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """The first TCMalloc shared library in `dirs`, by full path (a bare name would depend on ld.so's cache)."""
    for name in TCMALLOC_NAMES:
        for directory in dirs:
            path = os.path.join(directory, name)
            if exists(path):
                return path
    return None


def preloaded_allocator(ld_preload: str) -> str | None:
    """The allocator LD_PRELOAD already names (tcmalloc, jemalloc, mimalloc), or None."""
    for entry in ld_preload.replace(" ", ":").split(":"):
        base = os.path.basename(entry)
        for kind in ("tcmalloc", "jemalloc", "mimalloc"):
            if base.startswith(f"lib{kind}"):
                return kind
    return None


def active_allocator(maps_text: str) -> str:
    """The allocator this process really runs with, from its memory map (`/proc/self/maps`): a
    preload the loader refused (a missing file) shows as glibc, not as what LD_PRELOAD says."""
    for line in maps_text.splitlines():
        base = os.path.basename(line.rsplit(" ", 1)[-1])
        for kind in ("tcmalloc", "jemalloc", "mimalloc"):
            if base.startswith(f"lib{kind}"):
                return f"{kind} ({base})"
    return "glibc"


def allocator_line(active: str, device_type: str, choice: str) -> str:
    """The process's log line: what it runs with, and on a CPU under `auto` without TCMalloc, the fix."""
    hint = f"; {INSTALL_HINT} for a lower peak (docs/memory.md)" if \
        active == "glibc" and device_type == "cpu" and choice == "auto" else ""
    return f"memory plan: host allocator {active} (resources.host_allocator: {choice}){hint}"


def own_allocator() -> str:
    """`active_allocator` of this process; where there is no /proc, what LD_PRELOAD names."""
    try:
        with open("/proc/self/maps") as maps:
            return active_allocator(maps.read())
    except OSError:
        return preloaded_allocator(os.environ.get("LD_PRELOAD", "")) or "glibc"


def choose_allocator(choice: str, device_types: set[str], env: Mapping[str, str],
                     library: str | None) -> AllocatorChoice:
    """The allocator for processes on `device_types` under `resources.host_allocator: choice`.

    `auto` takes TCMalloc when every process is on the CPU and the library is here; on a GPU the
    model lives in the CUDA allocator's memory and the host's allocator is left alone. An
    allocator the user preloaded is kept as it is. `tcmalloc` without the library raises
    ValueError naming the fix (config/machine.py turns it into the field's error).
    """
    if choice not in CHOICES:
        raise ValueError(f"host allocator {choice!r} is not one of {', '.join(CHOICES)}")
    own = preloaded_allocator(env.get("LD_PRELOAD", ""))
    if own is not None and env.get(APPLIED_ENV) == own:
        return AllocatorChoice(own, "chosen by the process that started this one")
    if own is not None:
        return AllocatorChoice("preloaded", f"{own} from LD_PRELOAD, as set")
    if choice == "glibc":
        return AllocatorChoice("glibc", "resources.host_allocator: glibc")
    if choice == "auto" and not device_types <= {"cpu"}:
        return AllocatorChoice("glibc", "the model is on a GPU; resources.host_allocator: tcmalloc to change")
    if library is None:
        if choice == "tcmalloc":
            raise ValueError(f"no TCMalloc library ({' or '.join(TCMALLOC_NAMES)}) on this machine")
        return AllocatorChoice("glibc", f"no TCMalloc library here; {INSTALL_HINT} for a lower peak, docs/memory.md")
    old = env.get("LD_PRELOAD", "")
    added = {"LD_PRELOAD": f"{library}:{old}" if old else library}
    added.update({k: v for k, v in QUIET_LARGE_ALLOCS.items() if k not in env})
    why = "resources.host_allocator: tcmalloc" if choice == "tcmalloc" else "a CPU run, the library is here"
    return AllocatorChoice("tcmalloc", f"{library}, {why}", {**added, APPLIED_ENV: "tcmalloc"})


def needs_reexec(chosen: AllocatorChoice, env: Mapping[str, str]) -> bool:
    """Whether this process must restart itself to run with `chosen`: never twice."""
    return bool(chosen.env) and env.get(APPLIED_ENV) is None


def local_choice(choice: str, device_types: set[str]) -> AllocatorChoice:
    """`choose_allocator` for processes started from this one, on this machine."""
    library = find_tcmalloc(library_dirs([sys.prefix, os.environ.get("CONDA_PREFIX", "")]))
    return choose_allocator(choice, device_types, os.environ, library)


def usable_choice(choice: str, device_types: set[str]) -> AllocatorChoice | None:
    """`local_choice`, or None where an explicit `tcmalloc` has no library (check_machine refuses
    that by the field's name, before anything starts)."""
    try:
        return local_choice(choice, device_types)
    except ValueError:
        return None


def reexec(chosen: AllocatorChoice) -> None:
    """Run this process's own command line again under `chosen`'s environment (does not return).

    The interpreter's flags and arguments as given (`sys.orig_argv`), so the restarted command
    is the one the user typed (resume hints quote it); the interpreter by its full path, so a
    venv stays the venv. Output is flushed first; ignored signals stay ignored across exec.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **chosen.env})


_RELEASE: list[Callable[[], None] | None] = []


def release_free_memory() -> bool:
    """Hand the pages TCMalloc holds free back to the system (`MallocExtension_ReleaseFreeMemory`);
    False, doing nothing, under any other allocator.

    Why between a step's stages: TCMalloc keeps freed spans for reuse, and a stage whose tensors
    have other sizes than the last one's (the update after generation's KV cache) takes fresh
    pages beside them, so the resident peak carries the last stage's garbage. Released, the
    peak is the stage's own.
    """
    if not _RELEASE:
        import ctypes

        try:
            _RELEASE.append(ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory)
        except (AttributeError, OSError):
            _RELEASE.append(None)
    release = _RELEASE[0]
    if release is None:
        return False
    release()
    return True
