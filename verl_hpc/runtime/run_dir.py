"""The run directory: everything a run makes lives under it, nothing in it is overwritten.

Layout (docs/architecture.md): `config.yaml`, `data/`, `logs/<role>_rank<N>.log`,
`tensorboard/` (events + metrics.jsonl), `checkpoints/`, `hf_model/`.
Created 0700: on a shared cluster other users must not read rollouts or secrets.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from verl_hpc.config import ConfigError, RunConfig
from verl_hpc.config.checks import expand_path


def default_run_dir(name: str = "run") -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def holds_run(path: Path) -> bool:
    return (path / "config.yaml").exists() or (path / "tensorboard").exists()


def prepare_run_dir(run_dir: str | Path | None, cfg: RunConfig) -> Path:
    """Create the run directory, refusing one that already holds another run's outputs."""
    path = expand_path(str(run_dir)) if run_dir else default_run_dir()
    if holds_run(path) and not resumable(path, cfg):
        raise ConfigError("run_dir", f"{path} already holds a run and has no checkpoint to resume",
                          "choose a new --run-dir (outputs are never overwritten)")
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def resumable(path: Path, cfg: RunConfig) -> bool:
    """Whether `path` has a checkpoint this run would resume from (checkpoint.resume: auto)."""
    return cfg.checkpoint.resume != "never" and any((path / "checkpoints").glob("step_*"))
