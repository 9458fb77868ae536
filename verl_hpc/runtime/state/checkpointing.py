"""What a run checkpoints, when, and how it resumes, for every placement.

Why one checkpointer over a dict of state objects (torchtitan's `states`): the layout
(`{"actor": {"model", "optim"}, "critic": ...}` as tensors through DCP, counters and
data order as JSON) must be the same whatever the placement, so a run can be resumed on
another number of processes, and a new piece of run state is one more entry.

Randomness is re-seeded at every step (state/seeding.py), so a resumed run samples exactly
what the uninterrupted run sampled; the generators are still saved for inspection.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.checkpoint.manager import CheckpointManager, latest_checkpoint
from verl_hpc.config import ConfigError, RunConfig
from verl_hpc.roles.lora import trainable_state
from verl_hpc.runtime.state import run_state
from verl_hpc.utils.collective import broadcast_kept
from verl_hpc.utils.fs import expand_path
from verl_hpc.utils.logging import get_logger

log = get_logger("checkpoint")
RUN_STATE_FILE = "run_state.json"


def build_manager(cfg: RunConfig, run_dir: Path, process_group=None, async_group=None) -> CheckpointManager:
    ck = cfg.checkpoint
    return CheckpointManager(run_dir / "checkpoints", keep_last=ck.keep_last, keep_every=ck.keep_every,
                             async_save=ck.async_save, process_group=process_group, async_group=async_group)


def resume_path(cfg: RunConfig, run_dir: Path) -> Path | None:
    """`checkpoint.resume`: auto (newest committed, if any), never, or a path."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    # sha256, not only sizes: a bit flip keeps every size, and loading it would silently train
    # on corrupted weights; a corrupted newest checkpoint is skipped (warned) for the one before.
    if mode == "auto":
        return latest_checkpoint(run_dir / "checkpoints", verify="sha256")
    path = expand_path(mode)
    if (path / "checkpoints").is_dir():
        path = latest_checkpoint(path / "checkpoints", verify="sha256") or path
    if not (path / "manifest.json").is_file():
        raise ConfigError("checkpoint.resume", f"{path} is not a committed checkpoint",
                          "point it at a step_* directory from `verl-hpc ckpt list`, or use auto")
    return path


FORMAT_VERSION = 2  # run_state.json layout; 1 (no field) is the same layout without the version


class ModelState:
    """A trained role's tensors (model + optimizer) as a state object for DCP.

    Sharded DTensors under FSDP2: each rank writes and reads only its part, and DCP
    reshards when the run resumes on another number of ranks. Frozen parameters (a LoRA
    actor's base) are left out: the model directory holds them, unchanged.
    """

    def __init__(self, owner) -> None:  # owner: Actor or Critic (an OptimizedModel)
        self.owner = owner

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not p.requires_grad for p in self.owner.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=not frozen)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.owner.model, self.owner.optimizer, options=self._options())
        # ignore_frozen_params keeps a tied frozen weight under its second name (lm_head.weight)
        return {"model": trainable_state(self.owner.model, model_sd), "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.owner.model, self.owner.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self._options())


def describe_world(saved: dict[str, int] | None, now: dict[str, int]) -> str:
    """`saved by 1 trainer process` or `saved by 2 trainer + 1 critic processes, now 1 trainer process`."""
    def shown(sizes: dict[str, int]) -> str:
        total = sum(sizes.values())
        return " + ".join(f"{n} {group}" for group, n in sizes.items()) + f" process{'es' if total != 1 else ''}"

    if not saved:
        return f"now {shown(now)}"
    return f"saved by {shown(saved)}" + ("" if saved == now else f", now {shown(now)}")


class RunCheckpointer:
    """Cadence (steps, minutes, end, on request) + a dict of state objects around the manager.

    `tensor_states` (ModelState per trained role) go through DCP; `states` (trainer
    counters, prompt sampler, schedulers, allocator, rollout buffer) are small and go to
    run_state.json, each under its own key — the "trainer" state's keys at the top level,
    as checkpoints of format 1 have them.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, manager: CheckpointManager, world_sizes: dict[str, int],
                 is_leader: bool, group=None):
        self.cfg, self.run_dir, self.manager = cfg, run_dir, manager
        self.world_sizes, self.is_leader, self.group = world_sizes, is_leader, group
        self.last_save = time.monotonic()
        self.requested = False   # a synchronous save at this boundary: a stop, a resize
        self.ahead = False       # an asynchronous save at this boundary: the deadline is near
        self.suppressed = False  # no save at this boundary: the step was abandoned (and requeued)
        self.save_seconds = 0.0
        self.restore_seconds: float | None = None

    def due(self, step: int) -> bool:
        """Whether to save after `step`; every rank of the group gets the leader's answer."""
        ck = self.cfg.checkpoint
        due = self.requested or self.ahead or step == self.cfg.trainer.total_steps
        due = due or bool(ck.interval_steps and step % ck.interval_steps == 0)
        due = due or bool(ck.interval_minutes and time.monotonic() - self.last_save >= 60 * ck.interval_minutes)
        if self.suppressed:
            due = self.requested = False
        if self.group is not None and dist.get_world_size(self.group) > 1:
            # `requested` rides along: it decides a blocking save, which every rank must agree on.
            flags = torch.tensor([int(due), int(self.requested)])
            broadcast_kept(flags, dist.get_global_rank(self.group, 0), self.group)
            due, self.requested = bool(flags[0].item()), bool(flags[1].item())
        return due

    def save(self, step: int, states: dict[str, Any], tensor_states: dict[str, ModelState],
             block: bool | None = None, rank_files: dict[str, bytes] | None = None) -> Path:
        run: dict[str, Any] = {"format_version": FORMAT_VERSION}
        for name, obj in states.items():
            if name == "trainer":
                run.update(obj.state_dict())
            else:
                run[name] = obj.state_dict() if obj is not None else None
        lora = self.cfg.model.lora
        meta = {"world_sizes": self.world_sizes, "model_dir": str(expand_path(self.cfg.model.path)),
                "lora": lora.model_dump() if lora is not None else None,  # what `export` merges with
                "config_hash": run_state.config_hash((self.run_dir / "config.yaml").read_text()),
                "policy_version": run.get("policy_version"), "format_version": FORMAT_VERSION}
        start = time.perf_counter()
        tensors = {name: state.state_dict() for name, state in tensor_states.items()}
        path = self.manager.save(step, tensors, meta,
                                 rank_files={"rng.json": run_state.dumps(run_state.rng_state()), **(rank_files or {})},
                                 shared_files={RUN_STATE_FILE: run_state.dumps(run)},
                                 block=block)
        self.last_save, self.requested, self.ahead = time.monotonic(), False, False
        self.save_seconds = time.perf_counter() - start
        log.info("checkpoint of step %d %s (%.3fs stall)", step, "written" if block else "started",
                 self.save_seconds)
        return path

    def restore(self, path: Path, states: dict[str, Any], tensor_states: dict[str, ModelState]) -> dict[str, Any]:
        """Load every state (tensors resharded to this world); returns the run state.

        The format version is checked and every tensor read before anything is applied, so
        a checkpoint this version cannot read is refused whole, never half-loaded.
        """
        start = time.perf_counter()
        run = run_state.loads(self.manager.read_shared(path, RUN_STATE_FILE))
        version = int(run.get("format_version", 1))
        if version > FORMAT_VERSION:
            raise ConfigError("checkpoint.resume", f"{path} has checkpoint format version {version}; this "
                              f"verl-hpc reads versions up to {FORMAT_VERSION}",
                              "resume it with the verl-hpc that wrote it, or set checkpoint.resume: never")
        tensors = {name: state.state_dict() for name, state in tensor_states.items()}
        manifest = self.manager.load(path, tensors)
        for name, state in tensor_states.items():
            state.load_state_dict(tensors[name])
        recorded = manifest.get("meta", {}).get("world_sizes")
        for name, obj in states.items():
            if name == "trainer":
                obj.load_state_dict(run)
            elif obj is not None and run.get(name) is not None:
                if name.endswith("_allocator") and recorded != self.world_sizes:
                    continue  # new resources: the allocator learns its micro-batch sizes afresh
                obj.load_state_dict(run[name])
        # The duration and a sub-second wall clock ride along: the preemption benchmark splits a
        # restart into start-up and restore with them (the log's own time field has 1 s steps).
        seconds = self.restore_seconds = time.perf_counter() - start
        log.info("resumed from %s at step %d in %.3fs (%s)", path, run["step"], seconds,
                 describe_world(recorded, self.world_sizes), extra={"fields": {
                     "restore_s": round(seconds, 4), "unix_time": round(time.time(), 3),
                     "saved_world_sizes": recorded, "world_sizes": self.world_sizes}})
        return run
