"""The run directory: everything a run makes lives under it, nothing in it is overwritten.

Layout (docs/architecture.md): `config.yaml`, `data/`, `logs/<role>_rank<N>.log`,
`tensorboard/` (events + metrics.jsonl), `checkpoints/`, `hf_model/`, and after an
accepted config change `config_history.yaml` + `config_history/`.
Created 0700: on a shared cluster other users must not read rollouts or secrets.

A run directory has an identity, its config. Running into one that holds a run:

* same config, not finished: resume (from the newest checkpoint, or from step 0 when
  none was committed: the restart redoes exactly the same steps);
* finished (its newest checkpoint is of its last step: the run state, never `hf_model/`,
  which `trainer.save_hf_model: false` does not write) with the same config: refused,
  nothing to do; with only operational changes (below) they are recorded and the run is
  left as it is (`finished_step` tells the launcher there is nothing to train);
* another config: refused in one line naming the changed fields, unless the change is
  accepted (`--allow-config-change`, or `allow_config_change=True`). An accepted change
  is recorded in `config_history.yaml` with the step it takes effect at, the replaced
  `config.yaml` is kept byte for byte under `config_history/`, and an earlier end's
  `hf_model/` moves to `hf_model_step_<N>/`. Fields that change how, not what, a run
  computes (resources, Slurm, logging, checkpoint cadence; see `OPERATIONAL`) need no
  flag: a run resumes on other resources. Their change is recorded all the same.

Why a run with no progress (no checkpoint, no `hf_model/`, no metrics row) takes any
config: a failure at start-up (a bad reward, a device mismatch) must leave a directory
the corrected command can reuse; there is nothing in it a new config could disagree with.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from verl_hpc.config import ConfigError, RunConfig, dump_config, load_config
from verl_hpc.utils.fs import expand_path
from verl_hpc.utils.logging import get_logger

log = get_logger("run_dir")

HISTORY_FILE = "config_history.yaml"
EXPLICIT_FILE = "explicit_fields.json"  # the fields the config itself set (config/explicit.py)
HISTORY_DIR = "config_history"
ALLOW_ENV = "VERL_HPC_ALLOW_CONFIG_CHANGE"  # set by `verl-hpc train --allow-config-change`
# Dotted prefixes whose change leaves the run's numbers as they were: no flag needed.
OPERATIONAL = ("resources", "slurm", "logging", "checkpoint", "run_dir", "reward.on_error",
               "trainer.run_name", "trainer.torch_threads", "trainer.oom_retry", "trainer.min_micro_batch_size",
               "model.load",  # how the weights reach the ranks, not which weights
               "model.memory_plan", "model.memory_budget_gb", "model.memory_headroom")  # switches that keep the numbers


def default_run_dir(name: str = "run") -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def named_run_dir(cfg: RunConfig, config_path: str | Path | None) -> Path:
    """The run dir a config uses without `--run-dir`: `runs/<trainer.run_name or config file stem>`.

    Why deterministic: rerunning the same command after Ctrl-C must find its own run again
    (as verl's `trainer.default_local_dir` and torchtitan's `dump_folder` do).
    """
    if cfg.run_dir:
        return expand_path(cfg.run_dir)
    name = getattr(cfg.trainer, "run_name", None) or (Path(config_path).stem if config_path else None)
    return Path("runs") / name if name else default_run_dir()


def holds_run(path: Path) -> bool:
    return (path / "config.yaml").exists() or (path / "tensorboard").exists()


def prepare_run_dir(run_dir: str | Path | None, cfg: RunConfig, allow_config_change: bool | None = None) -> Path:
    """Create the run directory, or check that this config may continue the run it holds."""
    if run_dir:
        path = expand_path(str(run_dir))
    else:
        name = getattr(cfg.trainer, "run_name", None)
        path = Path("runs") / name if name else default_run_dir()
    if allow_config_change is None:
        allow_config_change = os.environ.get(ALLOW_ENV) == "1"
    if holds_run(path):
        _check_continuation(path, cfg, allow_config_change)
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


def committed_step(path: Path) -> int | None:
    """The newest committed checkpoint's step (a manifest is written last), if any."""
    steps = [int(d.name.removeprefix("step_")) for d in (path / "checkpoints").glob("step_*")
             if d.name.removeprefix("step_").isdigit() and (d / "manifest.json").is_file()]
    return max(steps) if steps else None


def total_steps_of(config_text: str | None) -> int | None:
    """`trainer.total_steps` of a stored config.yaml, read without validating the rest."""
    try:
        return int((yaml.safe_load(config_text or "") or {})["trainer"]["total_steps"])
    except (KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def finished_step(path: Path, total_steps: int | None = None) -> int | None:
    """The step the run in `path` finished at, or None while it has steps left.

    Why from the checkpoints: the last step is always saved (the run state of a finished
    run), whereas `hf_model/` exists only when `trainer.save_hf_model` is on. `total_steps`
    defaults to the run's own config.yaml; pass a new config's to ask "is there anything
    left to train under it".
    """
    step = committed_step(path)
    if total_steps is None:
        stored = path / "config.yaml"
        total_steps = total_steps_of(stored.read_text() if stored.is_file() else None)
    return step if step is not None and total_steps is not None and step >= total_steps else None


def has_progress(path: Path) -> bool:
    """Whether the run left anything a new config would contradict."""
    metrics = path / "tensorboard" / "metrics.jsonl"
    return committed_step(path) is not None or (path / "hf_model").exists() or \
        (metrics.is_file() and metrics.stat().st_size > 0)


def _check_continuation(path: Path, cfg: RunConfig, allow: bool) -> None:
    if cfg.checkpoint.resume == "never":
        raise ConfigError("run_dir", f"{path} already holds a run and checkpoint.resume is never",
                          "choose a new --run-dir (outputs are never overwritten)")
    stored_file = path / "config.yaml"
    stored = stored_file.read_text() if stored_file.is_file() else None
    new = dump_config(cfg)
    changed = config_changes(as_read_now(stored), new) if stored is not None else {}
    decisive = sorted(f for f in changed if not f.startswith(OPERATIONAL))
    step = committed_step(path) or 0
    finished = finished_step(path, total_steps_of(stored)) is not None
    if decisive and has_progress(path) and not allow:
        shown = ", ".join(decisive[:6]) + (f" and {len(decisive) - 6} more" if len(decisive) > 6 else "")
        raise ConfigError("run_dir", f"{path} already holds a run with another config: {shown} changed",
                          f"rerun with its config ({stored_file}), add --allow-config-change to continue it "
                          "under this one (recorded in config_history.yaml), or choose a new --run-dir or "
                          "trainer.run_name")
    if finished and stored == new:
        raise ConfigError("run_dir", f"{path} already holds a run that finished at step {step}",
                          "raise trainer.total_steps with --allow-config-change to train it further, "
                          "or choose a new --run-dir or trainer.run_name")
    if stored is not None and stored != new:  # the record lists fields an upgrade added too
        record_change(path, stored, config_changes(stored, new), step, (path / "hf_model").exists())


def as_read_now(stored: str) -> str:
    """A stored config as this version reads it: fields added since it was written take their defaults.

    Why: upgrading verl-hpc must not turn a run into "another config". Each new field
    (`model.gradient_checkpointing`, ...) would otherwise be a change from nothing to its
    default. A stored config this version cannot read is compared as written.
    """
    try:
        return dump_config(load_config(data=yaml.safe_load(stored)))
    except (ConfigError, ValueError, TypeError, OSError):
        return stored


def config_changes(old_text: str, new_text: str) -> dict[str, dict[str, Any]]:
    """Dotted field -> {old, new} for every leaf that differs (lists compare whole)."""
    old, new = _flatten(yaml.safe_load(old_text) or {}), _flatten(yaml.safe_load(new_text) or {})
    return {k: {"old": old.get(k), "new": new.get(k)} for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)}


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or not data:
        return {prefix.rstrip("."): data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def record_change(path: Path, stored: str, changed: dict[str, dict[str, Any]], step: int, exported: bool) -> None:
    """Keep the replaced config (and an earlier end's hf_model) and append the change to the history."""
    archive = path / HISTORY_DIR
    archive.mkdir(exist_ok=True)
    kept = _free_name(archive / f"config_step_{step:08d}.yaml")
    kept.write_text(stored)
    entry: dict[str, Any] = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             "changed": changed, "previous_config": str(kept.relative_to(path))}
    if exported:
        moved = _free_name(path / f"hf_model_step_{step:08d}")
        (path / "hf_model").rename(moved)
        entry["moved"] = {"hf_model": moved.name}
    history = path / HISTORY_FILE
    with open(history, "a", encoding="utf-8") as fh:
        fh.write(yaml.safe_dump([entry], sort_keys=False))
    fields = ", ".join(list(changed)[:6]) + (" ..." if len(changed) > 6 else "")
    log.warning("%s: config changed (%s); takes effect at step %d, recorded in %s", path, fields, step, history)


def _free_name(candidate: Path) -> Path:
    """`candidate`, or `candidate-2`, `-3`, ...: never replace what an earlier change kept."""
    if not candidate.exists():
        return candidate
    index = 2
    while True:
        stem = candidate.name.removesuffix(".yaml")
        other = candidate.with_name(f"{stem}-{index}{'.yaml' if candidate.suffix == '.yaml' else ''}")
        if not other.exists():
            return other
        index += 1


def write_explicit(path: Path, cfg: RunConfig) -> None:
    """Record which fields the launching config set, beside `config.yaml` (which lists every field).

    Why: automatic choices (the memory plan) may fill only what the user left out, and the
    worker processes read the full `config.yaml`, where a default and a choice look alike.
    """
    from verl_hpc.config.explicit import explicit_fields

    (Path(path) / EXPLICIT_FILE).write_text(json.dumps(sorted(explicit_fields(cfg)), indent=0) + "\n")


def read_explicit(path: Path) -> frozenset[str]:
    """The fields the run's config set; a run directory without the record keeps every memory switch."""
    from verl_hpc.config.explicit import MEMORY_SWITCHES

    file = Path(path) / EXPLICIT_FILE
    try:
        return frozenset(json.loads(file.read_text()))
    except (OSError, ValueError):
        return frozenset(MEMORY_SWITCHES)


def history(path: Path) -> list[dict[str, Any]]:
    """The accepted config changes of the run in `path`, oldest first."""
    file = Path(path) / HISTORY_FILE
    return list(yaml.safe_load(file.read_text()) or []) if file.is_file() else []
