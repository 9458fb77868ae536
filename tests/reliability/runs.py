"""Helpers for the fault-injection suite: training runs through the real CLI, small tmpfs mounts."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_cli

VOLATILE = ("timing_s/", "perf/", "memory/", "resource/")  # clock and machine readings, not training state


def train(run_dir: Path, model: Path, *extra: str, config: str = "configs/quickstart.yaml") -> subprocess.CompletedProcess:
    """`verl-hpc train` as a user runs it, small and quiet; returns the finished process."""
    return run_cli("train", config, "--run-dir", str(run_dir), f"model.path={model}", "logging.progress=off",
                   "trainer.save_hf_model=false", *extra)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def training_state(rows: list[dict]) -> list[dict]:
    """Per-step metrics without wall-clock and machine readings: what an exact resume must reproduce."""
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


@contextlib.contextmanager
def tmpfs(where: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A small RAM file system at `where` (needs root, as CI runs); skips the test where mounting fails."""
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
