"""The per-run shared secret that authenticates rollout workers to the trainer.

Why a file: every rank of one Slurm job sees the same run directory on the shared
filesystem, while other users of the cluster do not (given owner-only permissions).
A token in a 0600 file under a 0700 directory is therefore a capability only the job
owner's processes hold, without a key server or environment variables that leak into
`ps`/`scontrol show job` output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from pathlib import Path

TOKEN_BYTES = 32
_TOKEN_HEX_LEN = 2 * TOKEN_BYTES
_DIR_MODE = 0o700
_FILE_MODE = 0o600


def secret_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the token of `run_dir` lives; one place so writers and readers agree."""
    return Path(run_dir) / "secrets" / "flight_token"


def create_run_secret(run_dir: str | os.PathLike[str]) -> str:
    """Create (or reuse) the run's Flight token and return it.

    Why O_CREAT|O_EXCL with mode 0600: the file is born owner-only, so there is no
    window in which another user can open it, and when several ranks race to create
    it exactly one wins; the others read the winner's token instead of overwriting it.
    Why reuse: a restarted job (same run_dir) keeps talking to workers that already
    read the old token.
    """
    path = secret_path(run_dir)
    _ensure_private_dir(path.parent)
    token = secrets.token_hex(TOKEN_BYTES)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, _FILE_MODE)
    except FileExistsError:
        return read_run_secret(run_dir)
    try:
        os.fchmod(fd, _FILE_MODE)  # the umask may have narrowed it; we want exactly 0600
        _write_all(fd, token.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    return token


def read_run_secret(run_dir: str | os.PathLike[str], wait_s: float = 5.0) -> str:
    """Read the run's token, refusing a file that others could have read or replaced.

    Why wait: a reader may open the file between the creator's O_EXCL create and its
    write; a short poll for a complete token beats a spurious authentication failure.
    """
    path = secret_path(run_dir)
    deadline = time.monotonic() + wait_s
    while True:
        _check_private_file(path)
        token = path.read_text(encoding="ascii").strip()
        if len(token) == _TOKEN_HEX_LEN and all(c in "0123456789abcdef" for c in token):
            return token
        if time.monotonic() >= deadline:
            raise ValueError(f"{path}: does not hold a {_TOKEN_HEX_LEN}-character hex token; "
                             f"delete it to let the next start create a fresh one")
        time.sleep(0.05)


def _ensure_private_dir(directory: Path) -> None:
    """Create `directory` as 0700, or tighten an existing one we own to 0700."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, _DIR_MODE)  # born no wider than 0700 whatever the umask
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{directory}: expected a directory, found something else "
                              f"(a symlink?); remove it and start again")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{directory}: owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
                              f"use a run directory of your own")
    if stat.S_IMODE(st.st_mode) != _DIR_MODE:
        os.chmod(directory, _DIR_MODE)


def _check_private_file(path: Path) -> None:
    """Raise unless `path` is a regular file of ours with mode exactly 0600."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no Flight token yet; the trainer creates it with "
                                "create_run_secret(run_dir) before workers start", str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"{path}: not a regular file (a symlink?); delete it and start again")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path}: owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
                              f"refusing to trust it")
    mode = stat.S_IMODE(st.st_mode)
    if mode != _FILE_MODE:
        raise PermissionError(f"{path}: mode {mode:04o}, expected 0600 — others may have read the token. "
                              f"Delete the file so a fresh token is created (or `chmod 600` it if you are "
                              f"sure nobody else read it)")


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked; loop until everything is on disk."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
