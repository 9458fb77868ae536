"""Filesystem moves that never leave a half-written directory where users look."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
