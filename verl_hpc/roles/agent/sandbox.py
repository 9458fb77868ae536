"""A code tool that is actually sandboxed: model-written Python in a child process that cannot hurt the run.

What the child gets: its own empty temporary directory (its working directory and HOME), the
system's Python and libraries read-only, no network, its own PID namespace (so every process
it starts dies with it), an unprivileged uid (root ignores RLIMIT_NPROC, so a fork bomb needs
a uid of its own), and limits on CPU seconds, address space, file size, processes and wall
time. What it does not get: the run directory, the user's home, the job's environment.

Two backends, chosen once and logged: bubblewrap (`bwrap`, `apt-get install bubblewrap`) binds
only /usr, the interpreter and the work directory into an empty root; without it, `unshare`
gives new network, PID and mount namespaces and hides the run directory and homes under empty
tmpfs mounts. Anything denied — a socket, a write outside its directory, a read of the run
directory, a fork bomb, 10 GB of memory, an endless loop — ends as an error the model reads.
"""

from __future__ import annotations

import logging
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_hpc.roles.agent.tools import BaseTool

log = logging.getLogger(__name__)

_UID_BASE = 61000   # one unprivileged uid per concurrent run: RLIMIT_NPROC counts per uid
_UID_SLOTS = 256


@dataclass
class SandboxLimits:
    backend: str = "auto"
    cpu_seconds: int = 5
    memory_mb: int = 512
    wall_seconds: float = 10.0
    max_processes: int = 32
    max_output_bytes: int = 65536
    file_size_mb: int = 16

    @classmethod
    def of(cls, config: Any) -> SandboxLimits:
        """From `rollout.multi_turn.sandbox` (or a verl tool's `config:` mapping)."""
        get = config.get if isinstance(config, dict) else lambda k, d: getattr(config, k, d)
        return cls(**{k: get(k, v) for k, v in cls().__dict__.items()})


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    limit: str | None = None   # which limit ended it: "wall-clock", "cpu time", "memory"

    def text(self) -> str:
        """What the model reads."""
        parts = []
        if self.limit:
            parts.append(f"Error: killed by the sandbox's {self.limit} limit")
        elif self.returncode:
            parts.append(f"Error: exit code {self.returncode}")
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr.rstrip()}")
        return "\n".join(parts) if parts else "(no output)"


def python_for_sandbox() -> str:
    """An interpreter the unprivileged uid can run: the system's, else this one's real binary."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)


def choose_backend(preference: str = "auto") -> str:
    if preference == "bwrap" or (preference == "auto" and shutil.which("bwrap")):
        if not shutil.which("bwrap"):
            raise RuntimeError("sandbox backend bwrap asked for, but bwrap is not installed (apt-get install "
                               "bubblewrap)")
        return "bwrap"
    if not shutil.which("unshare"):
        raise RuntimeError("no sandbox backend: neither bwrap nor unshare is installed")
    return "unshare"


class _Uids:
    """A pool of unprivileged uids, one per run in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free = list(range(_UID_BASE, _UID_BASE + _UID_SLOTS))

    def take(self) -> int:
        with self.lock:
            return self.free.pop() if self.free else _UID_BASE + _UID_SLOTS

    def give(self, uid: int) -> None:
        with self.lock:
            if uid < _UID_BASE + _UID_SLOTS:
                self.free.append(uid)


_UIDS = _Uids()


def _bwrap_command(work: Path, python: str) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--ro-bind", "/usr", "/usr", "--dev", "/dev", "--proc", "/proc",
           "--bind", str(work), "/sandbox", "--chdir", "/sandbox", "--setenv", "HOME", "/sandbox",
           "--setenv", "TMPDIR", "/sandbox", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "PYTHONUNBUFFERED", "1"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):
        cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    home = Path(os.path.realpath(python)).parents[1]  # an interpreter outside /usr: bind its install only
    if not str(home).startswith("/usr"):
        cmd += ["--ro-bind", str(home), str(home)]
    cmd += ["--remount-ro", "/"]  # the empty root bwrap made: nothing outside /sandbox is writable
    return [*cmd, python, "-I", "/sandbox/main.py"]


def _unshare_command(work: Path, python: str, hidden: list[str], uid: int) -> list[str]:
    """Root only: new namespaces; the work directory bound to /mnt, then every world-writable place
    and the hidden paths covered by empty tmpfs mounts; the code runs as `uid`, a child of the
    namespace's init shell (an init process ignores SIGXCPU, its children do not)."""
    covered = [p for p in (*_WORLD_WRITABLE, *hidden) if os.path.isdir(p)]
    mounts = [f"mount --bind {shlex.quote(str(work))} /mnt"]
    mounts += [f"mount -t tmpfs -o size=4k,mode=000 none {shlex.quote(p)}" for p in covered]
    run = (f"cd /mnt && HOME=/mnt TMPDIR=/mnt setpriv --reuid {uid} --regid {uid} --clear-groups --inh-caps=-all "
           f"{shlex.quote(python)} -I /mnt/main.py")
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts",
            "sh", "-c", " && ".join([*mounts, run])]


_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")


def _limits(limits: SandboxLimits) -> Any:
    def apply() -> None:
        os.setsid()
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mb, limits.file_size_mb * mb))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _reader(stream: Any, keep: int, out: list[bytes]) -> threading.Thread:
    """Keep the first `keep` bytes of a pipe, drain (and drop) the rest so the child never blocks."""

    def read() -> None:
        size = 0
        while chunk := stream.read(65536):
            if size < keep:
                out.append(chunk[:keep - size])
            size += len(chunk)
        if size > keep:
            out.append(f"\n...(output cut at {keep} of {size} bytes)".encode())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def run_python_sandboxed(code: str, limits: SandboxLimits | None = None, hidden: list[str] | None = None) -> \
        SandboxResult:
    """Run `code` in the sandbox; never raises for what the code does."""
    limits = limits or SandboxLimits()
    backend, python = choose_backend(limits.backend), python_for_sandbox()
    uid = _UIDS.take()
    work = Path(tempfile.mkdtemp(prefix="verl-hpc-sandbox-", dir=_base_dir()))
    try:
        (work / "main.py").write_text(code)
        if os.geteuid() == 0:  # the unprivileged uid owns its directory, and nothing else
            os.chown(work, uid, uid)
            os.chown(work / "main.py", uid, uid)
        hide = [*(hidden or []), os.path.expanduser("~"), "/root", "/home"]
        inner = _bwrap_command(work, python) if backend == "bwrap" else _unshare_command(work, python, hide, uid)
        drop = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups"] \
            if backend == "bwrap" and os.geteuid() == 0 else []
        return _execute([*drop, *inner], limits)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        _UIDS.give(uid)


def _execute(cmd: list[str], limits: SandboxLimits) -> SandboxResult:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_limits(limits), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [_reader(proc.stdout, limits.max_output_bytes, out), _reader(proc.stderr, limits.max_output_bytes, err)]
    limit = None
    try:
        proc.wait(timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        limit = "wall-clock"
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: setpriv, bwrap/unshare, the PID namespace
        proc.wait()
    for reader in readers:
        reader.join(5)
    stdout, stderr = b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace")
    if limit is None and proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU,
                                             128 + signal.SIGKILL):
        limit = "cpu time"
    if limit is None and "MemoryError" in stderr:
        limit = "memory"
    return SandboxResult(proc.returncode, stdout, stderr, limit)


def _base_dir() -> str:
    """Where work directories are made: a root-only folder when root (the unshare backend hides /tmp)."""
    if os.geteuid() != 0:
        return tempfile.gettempdir()
    base = os.path.join(tempfile.gettempdir(), "verl-hpc-sandboxes")
    os.makedirs(base, mode=0o711, exist_ok=True)
    return base


_CONFIGURED: dict[str, Any] = {"limits": SandboxLimits(), "hidden": []}


def configure(limits: SandboxLimits, hidden: list[str]) -> str:
    """Set the code tool's limits and the paths it must never see (the run directory); the backend used."""
    _CONFIGURED.update(limits=limits, hidden=list(hidden))
    backend = choose_backend(limits.backend)
    log.info("code sandbox: %s (cpu %ss, memory %s MB, wall %ss, processes %s)", backend, limits.cpu_seconds,
             limits.memory_mb, limits.wall_seconds, limits.max_processes)
    return backend


def run_python(code: str) -> str:
    """Run Python code in a sandbox (no network, no files outside its own folder) and return what it printed.

    Args:
        code: the Python program to run; print what you want to see.
    """
    return run_python_sandboxed(code, _CONFIGURED["limits"], _CONFIGURED["hidden"]).text()


class CodeTool(BaseTool):
    """The sandboxed code tool in verl's tool-config form: `config:` holds the limits (SandboxLimits' keys)."""

    def __init__(self, config: dict[str, Any], tool_schema: Any):
        super().__init__(config, tool_schema)
        self.limits = SandboxLimits.of(self.config)
        self.hidden = list(self.config.get("hidden_paths", []))
        log.info("code sandbox for tool %s: %s", self.name, choose_backend(self.limits.backend))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        import asyncio

        code = str(parameters.get("code", ""))
        result = await asyncio.to_thread(run_python_sandboxed, code, self.limits,
                                         [*self.hidden, *_CONFIGURED["hidden"]])
        return result.text(), 0.0, {"returncode": result.returncode, "limit": result.limit}
