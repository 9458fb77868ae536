"""Everything around the step: resume, the step loop, checkpoints, stop, resize, export.

Why apart from the loop: the loop (loop.py) is the algorithm; when to save, how every
rank learns where to resume, what a stop signal or the job's end time does (checkpoint,
then requeue under Slurm: runtime/process/deadline.py has the rule) and how the trained
model is exported are the run's lifecycle, identical for every placement.
Placement-specific parts (agreeing on a stop across ranks, telling serving ranks to leave,
what else a checkpoint holds) are the placement's `Lifecycle` hooks.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_hpc.config import RunConfig
from verl_hpc.metrics import MetricSinks, Progress
from verl_hpc.metrics.history import WALL_CLOCK, StopRecord
from verl_hpc.runtime.process.deadline import Action, Agreement, boundary_action, stop_path, stopping_signal
from verl_hpc.runtime.process.signals import REQUEUE_SIGNALS, StopFlag
from verl_hpc.runtime.state import resize
from verl_hpc.runtime.state.checkpointing import ModelState, RunCheckpointer, resume_path
from verl_hpc.runtime.state.observe import RunObserver
from verl_hpc.runtime.state.time_limit import SAVE_ESTIMATE, STEP_ESTIMATE, TIME_LEFT, TimeLimit
from verl_hpc.runtime.step import validation
from verl_hpc.utils.logging import get_logger

log = get_logger("trainer")


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    hf_model_dir: Path | None
    last_metrics: dict[str, float] = field(default_factory=dict)
    stopped_by: str | None = None  # the signal that stopped the run early, or "deadline"


@dataclass
class Outcome:
    """How the step loop ended, for the worker's exit code and the result."""

    stopped_by: str | None = None   # signal name, deadline, resize, or "stop requested by the trainer"
    requeued: bool = False          # the leader's `scontrol requeue` went through
    wanted_requeue: bool = False    # the stop asked for one (USR1/USR2, the deadline)
    stop: StopRecord | None = None  # which path stopped the attempt, with the time left
    metrics: dict[str, float] = field(default_factory=dict)


def training_line(algorithm: str, done: int, total: int, run_dir: Path) -> str:
    """What the run is about to do: all of it, or (resumed) the steps it has left."""
    if done == 0:
        return f"training {algorithm} for {total} steps in {run_dir}"
    left = total - done
    if left <= 0:
        return f"{run_dir} is at step {done} of {total}: no steps left to train"
    return f"training {algorithm} for {left} more step{'s' if left > 1 else ''} ({done + 1}-{total} of {total}) in {run_dir}"


def _brief(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


class RunLifecycle:
    def __init__(self, cfg: RunConfig, run_dir: Path, trainer: Any, checkpointer: RunCheckpointer | None,
                 stop: StopFlag, limit: TimeLimit):
        self.cfg, self.run_dir, self.trainer, self.checkpointer, self.stop = cfg, run_dir, trainer, checkpointer, stop
        self.limit, self.clock = limit, limit.clock
        limit.saves = checkpointer.manager if checkpointer is not None else None
        self.placement = trainer.placement
        self.seat, self.hooks = self.placement.seat, self.placement.lifecycle
        self.last_saved_step: int | None = None

    # --- state ------------------------------------------------------------------------------
    def states(self) -> dict[str, Any]:
        """The run state this process holds (a critic group's ranks hold only the critic's)."""
        roles = self.placement.roles
        actor, critic = roles.actor, roles.critic
        states: dict[str, Any] = {"trainer": self.trainer, "sampler": self.trainer.sampler}
        if actor is not None:
            states.update(actor_scheduler=actor.scheduler, actor_allocator=actor.allocator)
        states["critic_scheduler"] = critic.scheduler if critic is not None else None
        states.update(self.hooks.states())
        return states

    def tensor_states(self) -> dict[str, ModelState]:
        roles = self.placement.roles
        tensors = {}
        if roles.actor is not None:
            tensors["actor"] = ModelState(roles.actor)
        if roles.critic is not None:
            tensors["critic"] = ModelState(roles.critic)
        return tensors

    def resume(self) -> None:
        """Trainer ranks load the newest checkpoint; every rank learns the step; engines get the weights."""
        share = self.placement.collectives.share_from_leader
        path = resume_path(self.cfg, self.run_dir) if self.seat.is_leader else None
        path, end = share((str(path) if path else None, self.clock.end))  # the leader's end time, to every rank
        self.limit.adopt(end)
        run: dict[str, Any] | None = None
        if path is not None and self.checkpointer is not None:
            run = self.checkpointer.restore(Path(path), self.states(), self.tensor_states())
        if path is not None:
            run = share(run)
            if self.checkpointer is None:  # a serving rank: counters and data order, no tensors
                self.trainer.load_state_dict(run)
                self.trainer.sampler.load_state_dict(run["sampler"])
            self.hooks.after_resume(Path(path), run,
                                    self.checkpointer.manager.read_shared if self.checkpointer else None)
            self.hooks.resume_weights(self.trainer.policy_version)

    def maybe_save(self, metrics: dict[str, float]) -> None:
        ckpt, step = self.checkpointer, self.trainer.step
        if ckpt is None:
            return
        self.clock.enter("save")
        if ckpt.due(step):
            final = step == self.cfg.trainer.total_steps or ckpt.requested
            ckpt.save(step, self.states(), self.tensor_states(), block=True if final else None,
                      rank_files=self.hooks.rank_files(step))
            self.last_saved_step = step
            if self.seat.is_leader:
                metrics["timing_s/save_checkpoint"] = ckpt.save_seconds  # the stall: the loop waited this long
        self.clock.add_saves(ckpt.manager.write_seconds)  # this rank's saves that committed since the last boundary
        ckpt.manager.write_seconds.clear()
        self.clock.save_in_flight_since = ckpt.manager.pending_since
        if self.seat.is_leader and ckpt.manager.commits:  # an async save commits during later steps
            done = ckpt.manager.commits[-1]
            ckpt.manager.commits.clear()
            metrics.update({"perf/checkpoint_save_s": done["save_seconds"], "perf/checkpoint_bytes": done["bytes"]})

    # --- the loop around the step --------------------------------------------------------------
    def run(self) -> Outcome:
        cfg, trainer, seat = self.cfg, self.trainer, self.seat
        self.resume()
        self.limit.seed(trainer.step, self.checkpointer.restore_seconds if self.checkpointer else None)
        observer = RunObserver(cfg, self.run_dir, seat.speaker)
        sinks = observer.open(trainer.step, self.clock.end.at)
        progress = Progress(cfg.trainer.total_steps, trainer.step, cfg.logging.progress) if seat.is_leader else None
        if seat.is_leader:
            log.info("%s", training_line(cfg.algorithm.name, trainer.step, cfg.trainer.total_steps, self.run_dir))
        ended, outcome = "failed", Outcome()
        try:
            if trainer.step == 0 and validation.due(cfg, 0):
                before = self.validate()
                if seat.is_leader and sinks is not None:
                    sinks.log_scalars(0, before)
                    log.info("validation before training: %s", _brief(before))
            outcome = self.steps(sinks, progress)
            ended = outcome.stopped_by or "finished"
            return outcome
        finally:
            if self.checkpointer is not None:
                self.checkpointer.manager.wait()
            if progress is not None:
                progress.close()
            observer.close(trainer.step, ended, outcome.stop)

    def steps(self, sinks: MetricSinks | None, progress: Progress | None) -> Outcome:
        cfg, trainer, seat = self.cfg, self.trainer, self.seat
        outcome = Outcome()
        self.clock.enter("step")
        while trainer.step < cfg.trainer.total_steps:
            metrics = self.hooks.guard(trainer.step + 1, trainer.next_step)
            if metrics is None:  # a serving rank told to stop by the trainer
                outcome.stopped_by = "stop requested by the trainer"
                return outcome
            self.clock.step_done()
            last = trainer.step == cfg.trainer.total_steps
            agreed, action = Agreement(), Action.CONTINUE
            if seat.trains:
                agreed = self.agree()
                action = boundary_action(agreed, self.clock.margin_s, last)
                self.arm_checkpoint(action, agreed.resizing)
            self.maybe_save(metrics)  # trainer ranks, and a critic group's ranks that share the checkpoint
            self.clock.enter("step")  # validation and logging count towards the next step
            if validation.due(cfg, trainer.step):
                metrics.update(self.validate())
            if seat.is_leader:
                metrics.update(self.budget_metrics(agreed))
            self.log_step(metrics, sinks, progress)
            if seat.is_leader:
                outcome.metrics = metrics
            if agreed.resizing:
                self.hooks.stop_services()
                if seat.is_leader:
                    resize.accept(self.run_dir, trainer.step)
                outcome.stopped_by = resize.RESIZE_REASON
                return outcome
            if action in (Action.STOP, Action.STOP_UNSAVED, Action.ABANDONED):
                return self.stop_early(agreed, action, outcome)
        self.clock.enter("done")  # every step is saved: nothing left for the watchdog to abandon
        self.finish()
        return outcome

    def agree(self) -> Agreement:
        """Every trainer rank: the stop signal, the slowest estimates, the least time left, as one."""
        stop, clock = self.stop, self.clock
        signum = stopping_signal(stop.times, clock.end.at, clock.grace_s)
        return self.hooks.agree(signum, clock.budget(), clock.abandoned)

    def arm_checkpoint(self, action: Action, resizing: bool) -> None:
        """What this boundary saves: nothing after an abandoned step, synchronously before a stop,
        ahead (asynchronously) when the next boundary will likely stop, unless the last one saved."""
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if action in (Action.ABANDONED, Action.STOP_UNSAVED):
            ckpt.suppressed = True
        elif action is Action.STOP or resizing:
            ckpt.requested = True
        elif action is Action.SAVE_AHEAD and self.last_saved_step != self.trainer.step - 1:
            ckpt.ahead = True

    def budget_metrics(self, agreed: Agreement) -> dict[str, float]:
        """The agreed estimates (and the time left, when an end time is known) in the step's row."""
        budget = agreed.budget
        out = {STEP_ESTIMATE: budget.step_s, SAVE_ESTIMATE: self.clock.save_estimate()}
        if budget.known:
            out[TIME_LEFT] = budget.left_s
        return out

    def validate(self) -> dict[str, float]:
        """Trainer ranks validate (the leader gets the metrics); serving ranks do their part."""
        p, step = self.placement, self.trainer.step
        if p.stages is not None:
            return validation.validate(self.cfg, p.stages, p.collectives, self.trainer.policy_version, step)
        if p.service is not None:
            p.service.serve_validation(step)
        return {}

    def log_step(self, metrics: dict[str, float], sinks: MetricSinks | None, progress: Progress | None) -> None:
        """The leader logs the step; a serving group's first rank logs its own part of it."""
        cfg, step = self.cfg, self.trainer.step
        if sinks is not None and metrics and (step % cfg.logging.log_every == 0 or step == cfg.trainer.total_steps):
            sinks.log_scalars(step, {**metrics, WALL_CLOCK: time.time()})
            batch = self.trainer.last_batch
            if self.seat.is_leader and step % cfg.logging.sample_every == 0 and cfg.logging.num_samples \
                    and batch is not None:
                sinks.log_text(step, "samples", self.trainer.samples_text(batch))
        if progress is not None:
            name, key = self.trainer.progress_metric
            progress.update(step, {name: metrics.get(key, float("nan")),
                                   "s/step": metrics.get("timing_s/step", float("nan"))})

    def stop_early(self, agreed: Agreement, action: Action, outcome: Outcome) -> Outcome:
        """After the boundary's checkpoint (none when abandoned or it would not fit): stop the serving
        ranks, let a save still writing commit (the requeue's SIGTERM would cut it off), requeue."""
        self.hooks.stop_services()
        if self.checkpointer is not None:
            self.clock.enter("save")  # the watchdog guards the wait as a save
            self.checkpointer.manager.wait()
        self.clock.enter("stopping")
        signum, budget = agreed.signum, agreed.budget
        # An abandoned step is the deadline's doing: a SIGTERM seen then is its own requeue's.
        abandoned = action is Action.ABANDONED
        path = "deadline" if abandoned else stop_path(signum, self.stop.times, self.clock.end.at, self.clock.grace_s)
        outcome.stop = StopRecord(path, StopFlag.name(signum) if signum and not abandoned else None,
                                  budget.left_s if budget.known else None, budget.step_s, budget.save_s,
                                  self.clock.margin_s, abandoned=abandoned,
                                  phase=self.clock.abandoned_in if abandoned else None)
        outcome.stopped_by = StopFlag.name(signum) if signum else "deadline"
        outcome.wanted_requeue = signum is None or signum in REQUEUE_SIGNALS
        if self.seat.is_leader:
            outcome.requeued, message = self.limit.requeue_once(signum)
            saved = {Action.ABANDONED: "no checkpoint of it: abandoned",
                     Action.STOP_UNSAVED: "no checkpoint of it: a save would not fit"}.get(action, "checkpoint saved")
            log.warning("stopped by %s after step %d (%s); %s", outcome.stop.describe(), self.trainer.step, saved,
                        message, extra={"fields": {"stop": outcome.stop.to_json()}})
            if self.seat.processes > 1:
                print(f"verl-hpc: {message}", file=sys.stderr, flush=True)
        return outcome

    def finish(self) -> None:
        """The end: every rank meets, then the trained policy is exported as a Hugging Face directory."""
        p = self.placement
        if self.checkpointer is not None:
            self.checkpointer.manager.wait()
        p.collectives.barrier("end")
        if not self.cfg.trainer.save_hf_model or not self.seat.trains:
            return
        model = self.hooks.export_model()
        if model is not None:
            from verl_hpc.checkpoint.hf_export import save_hf_directory

            model = _plain(model, self.cfg)

            save_hf_directory(model, p.roles.tokenizer, self.run_dir / "hf_model")
            log.info("saved %s", self.run_dir / "hf_model")


def _plain(model: Any, cfg: RunConfig) -> Any:
    """`model` as its plain architecture: a LoRA actor's adapters merged into a fresh copy of the base."""
    from verl_hpc.transport.weights.views import has_adapters

    if not has_adapters(model):
        return model
    from verl_hpc.runtime.build import DTYPES, load_causal_lm
    from verl_hpc.transport.weights.bucketed import stream_into
    from verl_hpc.utils.fs import expand_path

    merged = load_causal_lm(str(expand_path(cfg.model.path)), DTYPES[cfg.model.dtype])
    stream_into(model, merged)
    return merged
