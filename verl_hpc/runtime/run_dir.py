"""The run directory: everything a run makes lives under it, nothing in it is overwritten.

Layout (docs/architecture.md): `config.yaml`, `data/`, `logs/<role>_rank<N>.log`,
`tensorboard/` (events + metrics.jsonl), `checkpoints/`, `hf_model/`.
Created 0700: on a shared cluster other users must not read rollouts or secrets.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from verl_hpc.config import ConfigError, RunConfig, dump_config
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
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")  # root ignores modes, so only a real write says it is writable
        probe.unlink()
    except OSError as err:
        raise ConfigError("run_dir", f"cannot write to {path}: {err.strerror or err}",
                          "choose a --run-dir on a writable file system with free space") from None
    return path


def resumable(path: Path, cfg: RunConfig) -> bool:
    """Whether this run may continue in `path` (checkpoint.resume: auto).

    Yes with a committed checkpoint. Also when the run died before its first one (killed
    during start-up or its first steps) and `config.yaml` is exactly this config: the
    restart redoes the same steps from step 0, so nothing the user made is lost or changed.
    """
    if cfg.checkpoint.resume == "never":
        return False
    if any((path / "checkpoints").glob("step_*")):
        return True
    stored = path / "config.yaml"
    unfinished = not (path / "hf_model").exists()
    return unfinished and stored.is_file() and stored.read_text() == dump_config(cfg)
