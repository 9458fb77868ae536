"""Filesystem writes and moves that never leave a half-written file or directory where readers look."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def expand_path(path: str) -> Path:
    """`~` and `$VARS` expand; relative paths are relative to the working directory."""
    return Path(os.path.expandvars(os.path.expanduser(path)))


def replace_dir(staging: Path, out_dir: Path) -> None:
    """Rename a complete `staging` directory to `out_dir`.

    An existing `out_dir` is first moved aside (not deleted), so at every instant the path
    holds either the old complete directory or the new one; the old one is removed last.
    """
    if out_dir.exists():
        previous = out_dir.with_name(f".{out_dir.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(out_dir, previous)
        os.replace(staging, out_dir)
        shutil.rmtree(previous, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


def write_atomic(path: Path, text: str) -> None:
    """Readers polling `path` (the trainer leader reading a resize request, Prometheus re-reading a
    file_sd target) see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
