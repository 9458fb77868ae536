"""Where a trainer rank's same-node rollout socket lives, and sweeping up after killed trainers.

Why a sweep: the socket's private directory is removed when the server shuts down, but a
trainer killed outright (kill -9, Slurm's SIGKILL after KillWait, a node's OOM killer)
never gets to, and each such run left a directory behind in /dev/shm (30 after one day
of this project's tests). Every new server therefore removes this user's directories
whose socket no longer has a listener, once they are old enough that they cannot be a
server still starting up.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import time

PREFIX = "verl-hpc-rollouts-"
SOCKET_NAME = "rollouts.sock"
STALE_AFTER_S = 60.0  # younger directories may belong to a server between mkdtemp and bind


def base_dir() -> str | None:
    """/dev/shm where it is writable (memory, node-local), else the system's temp directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def make_private_dir() -> str:
    """A fresh directory only this user can enter (mode 0700): the socket's permission boundary."""
    return tempfile.mkdtemp(prefix=PREFIX, dir=base_dir())


def has_listener(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket at `path` (False: none, or no file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError as exc:  # refused or no socket file: nobody; a full backlog or a timeout: someone
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
    finally:
        probe.close()


def sweep_stale(base: str | None = None, stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Remove this user's socket directories under `base` that nothing listens on; returns them."""
    root = base or base_dir() or tempfile.gettempdir()
    removed: list[str] = []
    now, uid = time.time(), os.getuid()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid != uid or now - info.st_mtime < stale_after_s:
            continue
        if has_listener(os.path.join(entry.path, SOCKET_NAME)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
