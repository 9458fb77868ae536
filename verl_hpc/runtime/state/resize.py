"""Resizing a running run: a request file, read at a step boundary, applied by a restart.

Why a checkpointed restart and not workers joining in place: a torch.distributed world
has a fixed size from `init_process_group` on, and every process group (FSDP's, the
weight-sync broadcasts, the reward scatter) is cut from it. So a resize is:

1. `request_resize` (the CLI `verl-hpc resize`, or `update_resource` in Python) validates
   the new resources against the run's config and writes `resize_request.yaml` atomically.
2. The trainer leader sees the file at the next step boundary; the trainer ranks agree,
   save a synchronous checkpoint, tell the other roles to stop, and the leader renames the
   request to `resize_accepted.yaml` (only after the checkpoint is committed).
3. The launcher (local: `launch_local`; Slurm: the batch script, via `verl-hpc resubmit`)
   calls `apply_accepted`: the new config becomes `config.yaml`, the change is appended to
   `config_history.yaml` (the first config is kept as `config.original.yaml`), and the
   world is started again with the new plan; it resumes from that checkpoint, resharded.

Nothing is lost or done twice: rollouts are scored on the trainer side of the step, and
the step that saw the request is complete (scored, trained, checkpointed) before anyone
stops; the next step starts from the checkpoint in the new world.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from verl_hpc.config import ROLE_NAMES, ConfigError, RunConfig, dump_config, load_config, read_yaml
from verl_hpc.config.placement import plan_for_config
from verl_hpc.utils.fs import write_atomic
from verl_hpc.utils.logging import get_logger

log = get_logger("resize")

REQUEST_FILE = "resize_request.yaml"
ACCEPTED_FILE = "resize_accepted.yaml"
HISTORY_FILE = "config_history.yaml"
ORIGINAL_FILE = "config.original.yaml"
RESIZE_REASON = "resize"  # what DistributedTrainer.train() returns when it stopped for a resize
# Only fields that decide where and how many processes run: anything else would change the
# algorithm mid-run, which a resize must not do silently.
RESIZABLE_FIELDS = ("device_ids", "device_type", "strategy", "nodes", "tasks_per_node", "gpus_per_node",
                    "cpus_per_task", "mem", "partition")


def normalize(items: list[str]) -> list[str]:
    """`reward.device_ids=[2,4]` (or `resources.reward...`) -> `resources.reward.device_ids=[2,4]`."""
    result = []
    for item in items:
        key, sep, value = item.partition("=")
        parts = key.split(".")
        if parts[0] == "resources":
            parts = parts[1:]
        if not sep or len(parts) != 2 or parts[0] not in ROLE_NAMES or parts[1] not in RESIZABLE_FIELDS:
            raise ConfigError(f"resources.{'.'.join(parts)}", f"{item!r} is not a resize of one role's resources",
                              f"use ROLE.FIELD=VALUE with ROLE in {', '.join(ROLE_NAMES)} and FIELD in "
                              f"{', '.join(RESIZABLE_FIELDS)}, e.g. reward.device_ids=[2,4]")
        result.append(f"resources.{parts[0]}.{parts[1]}={value}")
    return result


def overrides_for(component: str, **fields: Any) -> list[str]:
    """The Python API's keyword form (`device_ids=[2, 4]`) as override strings."""
    items = [f"{component}.{name}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...')}"
             for name, value in fields.items() if value is not None]
    if not items:
        raise ConfigError(f"resources.{component}", "nothing to change", "pass device_ids=, strategy=, ...")
    return normalize([i.strip() for i in items])


def resized_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The run's current config with the resize applied, validated like any config."""
    config_path = Path(run_dir) / "config.yaml"
    if not config_path.is_file():
        raise ConfigError("run_dir", f"{run_dir} holds no run (no config.yaml)",
                          "pass the --run-dir of a running `verl-hpc train` or `verl-hpc submit`")
    return load_config(config_path, overrides)


def request_resize(run_dir: str | Path, overrides: list[str]) -> Path:
    """Validate and record a resize (merged with one still pending); returns the request file.

    Fails before anything is written when the result is not a valid config, changes
    nothing, or the run is a single process (the embedded trainer has no launcher to
    restart it: stop it and start again with the new resources).
    """
    run_dir = Path(run_dir)
    pending = read_yaml(run_dir / REQUEST_FILE).get("overrides", []) if (run_dir / REQUEST_FILE).is_file() else []
    merged = _merge([*pending, *normalize(overrides)])
    before = load_config(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else None
    after = resized_config(run_dir, merged)
    if before is not None and plan_for_config(before).world_size == 1:
        raise ConfigError("resources", f"the run in {run_dir} is one process (the embedded trainer), which "
                          "cannot be resized while it runs", "stop it and run it again with the new resources; "
                          "it resumes from its last checkpoint")
    if before is not None and before.resources == after.resources:
        raise ConfigError(merged[-1].split("=")[0], "this resize changes nothing", "give other values")
    entry = {"requested_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": merged}
    path = run_dir / REQUEST_FILE
    write_atomic(path, yaml.safe_dump(entry, sort_keys=False))
    log.info("resize requested for %s: %s", run_dir, ", ".join(merged))
    return path


def _merge(overrides: list[str]) -> list[str]:
    """Later values for the same key win; order of first appearance is kept."""
    merged: dict[str, str] = {}
    for item in overrides:
        merged[item.partition("=")[0]] = item
    return list(merged.values())


def pending(run_dir: Path) -> bool:
    return (run_dir / REQUEST_FILE).is_file()


def accept(run_dir: Path, step: int) -> None:
    """Leader, after the checkpoint of `step` is committed: the request becomes the launcher's job."""
    os.replace(run_dir / REQUEST_FILE, run_dir / ACCEPTED_FILE)  # a request written later stays pending
    request = read_yaml(run_dir / ACCEPTED_FILE)
    request["accepted_after_step"] = step
    write_atomic(run_dir / ACCEPTED_FILE, yaml.safe_dump(request, sort_keys=False))
    log.warning("stopping after step %d to resize: %s", step, ", ".join(request["overrides"]))


def accepted(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / ACCEPTED_FILE
    return read_yaml(path) if path.is_file() else None


def apply_accepted(run_dir: Path) -> RunConfig:
    """Launcher side: the accepted resize becomes config.yaml, recorded in the history.

    `config.original.yaml` keeps the config the run started with; `config_history.yaml`
    gets one entry per resize (when, after which step, what changed from what).
    """
    request = accepted(run_dir)
    if request is None:
        raise FileNotFoundError(f"no {ACCEPTED_FILE} in {run_dir}")
    config_path = run_dir / "config.yaml"
    before = load_config(config_path)
    after = resized_config(run_dir, request["overrides"])
    original = run_dir / ORIGINAL_FILE
    if not original.exists():
        original.write_text(config_path.read_text())
    roles = sorted({item.split(".")[1] for item in request["overrides"]})
    entry = {"applied_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "after_step": request.get("accepted_after_step"),
             "overrides": request["overrides"],
             "before": {r: _role_dump(before, r) for r in roles}, "after": {r: _role_dump(after, r) for r in roles},
             "world_size": {"before": plan_for_config(before).world_size,
                            "after": plan_for_config(after).world_size}}
    with open(run_dir / HISTORY_FILE, "a") as fh:
        fh.write(yaml.safe_dump([entry], sort_keys=False, default_flow_style=None))
    write_atomic(config_path, dump_config(after))
    (run_dir / ACCEPTED_FILE).unlink()
    log.warning("resized after step %s: %s (world size %d -> %d); history in %s", entry["after_step"],
                ", ".join(request["overrides"]), entry["world_size"]["before"], entry["world_size"]["after"],
                run_dir / HISTORY_FILE)
    return after


def _role_dump(cfg: RunConfig, role: str) -> dict[str, Any] | None:
    spec = cfg.resources.role(role)
    return None if spec is None else spec.model_dump(mode="json", exclude_none=True)


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The resizes applied to the run, oldest first.

    config_history.yaml also holds the config changes a rerun recorded (`run_dir.record_change`,
    entries without `after_step`); those are not resizes.
    """
    path = run_dir / HISTORY_FILE
    entries = (yaml.safe_load(path.read_text()) or []) if path.is_file() else []
    return [entry for entry in entries if isinstance(entry, dict) and "after_step" in entry]
