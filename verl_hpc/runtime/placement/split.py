"""Split: the rollout group generates on devices of its own; rollouts reach the trainers over Arrow Flight.

Why this shape: rollout ranks generate slices of the step's prompt groups and put each row
straight to the Flight server of the trainer rank that trains it (transport/rollouts/intake.py:
no rank-0 funnel). Each trainer rank files what it receives by step; with `max_staleness: k`
the rollout runs k steps ahead, and the batches a rank has not yet trained on are part of its
checkpoint. After the update the actor's weights are broadcast to the rollout group in
buckets (transport/weights/). Each rollout is stamped with the policy version it came from.
This module is the trainer side; rollout_service.py is the rollout ranks' side.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl_hpc.config import RunConfig
from verl_hpc.data.layout import even_owner, even_slices, row_owner
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.build import Roles
from verl_hpc.runtime.placement.distributed import DistributedLifecycle, DistributedStages
from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.runtime.step import validation
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.metrics import turn_versions
from verl_hpc.runtime.step.stages import SyncReport
from verl_hpc.transport.rollouts.intake import BUFFER_FILE, RolloutRouter, TrainerIntake, bind_host, positions
from verl_hpc.transport.weights.base import WeightSender
from verl_hpc.transport.weights.bucketed import stop_header
from verl_hpc.transport.weights.sender import GatherJoin, ShardSender, weight_sender
from verl_hpc.utils.collective import broadcast_kept
from verl_hpc.utils.logging import get_logger

log = get_logger("placement")

ROUND_STRIDE = 1 << 40  # dynamic sampling: round r of step s is filed as s + r * ROUND_STRIDE


def round_key(step: int, round_: int) -> int:
    """The `step` stamped on the rows of a step's generation round (round 0: the step itself)."""
    return step + round_ * ROUND_STRIDE


def val_key(trained: int) -> int:
    """The `step` stamped on validation rows after step `trained` (negative: never a training step)."""
    return -1 - trained


def last_needed(cfg: RunConfig) -> int:
    """The last step whose weights the rollout needs for training rollouts."""
    return cfg.trainer.total_steps - cfg.algorithm.max_staleness - 1


def validation_rows(cfg: RunConfig, roles: Roles) -> int:
    return len(roles.val_prompt_ids or []) * cfg.trainer.val_n


@dataclass
class ResumePoint:
    """Where a resumed run picks up (every rank learns it in `after_resume`)."""

    step: int = 0
    buffered_steps: int = 0  # steps whose rollouts came from the checkpoint


def describe(sender: WeightSender) -> str:
    """One log line on how this trainer rank sends its weights."""
    if isinstance(sender, ShardSender):
        return "every trainer rank sends its own rows to the rollout, no gather"
    if isinstance(sender, GatherJoin):
        return "this rank joins the leader's gathers and sends nothing itself"
    if sender.overlaps:
        return ("the actor's parameters are one flat buffer: syncs send views, no packing, and overlap the "
                "next step until its optimizer step")
    return "the leader broadcasts every bucket"


class SplitLinks:
    """The split run's wires, made once on every rank: each trainer rank's Flight endpoint (intake),
    each rollout rank's clients of all of them (router), and each trainer rank's end of the weight
    syncs (transport/weights/base.py)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, roles: Roles, ctx: DistContext, trains: bool, rank: int,
                 is_leader: bool):
        self.intake: TrainerIntake | None = None  # every trainer rank: its endpoint, its rows by step
        self.router: RolloutRouter | None = None  # every rollout rank: a client per trainer rank
        self.sender: WeightSender | None = None   # every trainer rank's end of the weight syncs
        self.resume = ResumePoint()
        self.connect(run_dir, ctx, trains, rank, is_leader)
        if trains:
            actor = roles.actor
            self.sender = weight_sender(actor.model, actor.optimizer, ctx.weight_links())  # type: ignore[union-attr]
            log.info("weight syncs: %s", describe(self.sender))

    def connect(self, run_dir: Path, ctx: DistContext, trains: bool, rank: int, is_leader: bool) -> None:
        """Every trainer rank serves Flight; every rollout rank learns all their addresses and connects."""
        from verl_hpc.transport.secret import read_run_secret

        token = read_run_secret(run_dir)
        mine: tuple[int, str, str | None] | None = None
        if trains:
            self.intake = TrainerIntake(bind_host(ctx.env.master_addr, is_leader), token, capacity=8)
            mine = (rank, self.intake.location, self.intake.local_location)
        everyone: list[Any] = [None] * dist.get_world_size(ctx.control_group)
        dist.all_gather_object(everyone, mine, group=ctx.control_group)
        endpoints = sorted((x for x in everyone if x is not None), key=lambda x: x[0])
        if ctx.is_role("rollout"):
            self.router = RolloutRouter([e[1] for e in endpoints], token, f"rollout{ctx.rank_in_group}",
                                        [e[2] for e in endpoints])

    def owners(self, cfg: RunConfig, roles: Roles, batch: RolloutBatch, validation: bool = False,
               world: int | None = None) -> np.ndarray:
        """The trainer rank of each row (of `world`, default: every trainer rank this rollout rank
        sends to): the training layout's, or validation's even slices."""
        where = positions(batch, cfg.algorithm.sampling.n)
        world = world if world is not None else len(self.router.clients)  # type: ignore[union-attr]
        if validation:
            return even_owner(where, validation_rows(cfg, roles), world)
        size = cfg.trainer.batch_size
        return row_owner(where, size, cfg.algorithm.mini_batch_size or size, world)

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        if self.intake is not None:
            self.intake.shutdown()


class SplitStages(DistributedStages):
    """A trainer rank of a split run: its rows arrive over the wire; its weights leave over it."""

    def __init__(self, *args: Any, links: SplitLinks, ctx: DistContext, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.links, self.ctx = links, ctx
        self.leader = ctx.plan.group_ranks(ctx.plan.groups[0].name)[0]

    @property
    def intake(self) -> TrainerIntake:
        assert self.links.intake is not None
        return self.links.intake

    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        """This rank's rows of the step, as the producers sent them here: nothing passes through rank 0."""
        expected = len(self.seat.rows)
        with timer("wait_rollout"):
            batch = self.intake.take(round_key(step, round_), expected, self.ctx.timeout_seconds,
                                     lambda have: self.undelivered(step, have, expected))
            self.check_staleness(batch, policy_version, step)
        return self.score(batch, timer)

    def intake_metrics(self) -> dict[str, float]:
        """Rank 0's own intake (the number that must fall as O(batch / W)), the largest rank's, the total.

        Every trainer rank calls it (two reductions). Rollouts restored from a checkpoint count 0."""
        mine = self.intake.counters()
        keys = sorted(mine)
        values = torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64)
        largest, total = self.collectives.reduce_max(values), self.collectives.reduce_sum(values)
        out = {f"perf/rollout_intake_{k}": float(mine[k]) for k in keys}
        out.update({f"perf/rollout_intake_{k}_max_rank": float(v) for k, v in zip(keys, largest, strict=True)})
        out.update({f"perf/rollout_intake_{k}_total": float(v) for k, v in zip(keys, total, strict=True)})
        return out

    def undelivered(self, step: int, have: int, expected: int) -> str:
        ctx = self.ctx
        ranks = ctx.plan.group_ranks(ctx.plan.group_of_role("rollout").name)
        return (f"step {step}: trainer rank {self.seat.rank} got {have} of its {expected} rollouts within "
                f"timeout_seconds={ctx.timeout_seconds:g}; rollout rank(s) {ranks} did not deliver "
                "(hint: see logs/rollout_rank*.out)")

    def check_staleness(self, batch: RolloutBatch, policy_version: int, step: int) -> None:
        """Every trainer rank raises alike: the largest lag over all of them decides. The bound holds
        per turn: an episode's oldest turn counts (with partial rollouts its later turns are newer)."""
        own = policy_version - min((v for row in turn_versions(batch) for v in row), default=policy_version)
        lag = int(self.collectives.reduce_max(torch.tensor([own], dtype=torch.float64))[0])
        if lag > self.cfg.algorithm.max_staleness:
            raise RuntimeError(f"step {step}: a rollout is {lag} policy versions old, above "
                               f"algorithm.max_staleness={self.cfg.algorithm.max_staleness}")

    def sync_weights(self, version: int, changed: bool, step: int) -> SyncReport:
        """Every step (the rollout ranks expect it) until the rollout has generated its last batch;
        after that only for a step that is validated (`validation_tail`)."""
        if step > last_needed(self.cfg) and not validation.due(self.cfg, step):
            return SyncReport(overlapped=self.overlapped)
        return SyncReport(self.send(version), self.overlapped)

    @property
    def overlapped(self) -> bool:
        return self.links.sender is not None and self.links.sender.overlaps

    def send(self, version: int) -> int:
        assert self.links.sender is not None
        return self.links.sender.send(version)

    def next_round(self, more: bool) -> None:
        group = self.ctx.sync_groups.get("rollout")
        if group is not None:  # the leader: the rollout ranks wait for the verdict
            verdict = torch.tensor([int(more)], dtype=torch.int64, device=self.roles.device)
            broadcast_kept(verdict, self.leader, group)

    def validation_rollouts(self, step: int, policy_version: int) -> RolloutBatch:
        """The rollout group generated them with this step's weights and sent each rank its slice."""
        start, end = even_slices(validation_rows(self.cfg, self.roles), self.seat.world, self.seat.rank)
        return self.intake.take(val_key(step), end - start, self.ctx.timeout_seconds,
                                lambda have: self.undelivered(step, have, end - start) + " (validation)")


class _BufferedSteps:
    """How many steps of rollouts a checkpoint carries (run_state.json's `buffered_steps`)."""

    def __init__(self, owner: SplitLifecycle):
        self.owner = owner

    def state_dict(self) -> int:
        return self.owner.buffered_for_save

    def load_state_dict(self, value: int) -> None:
        """Applied in `after_resume`, which every rank runs (serving ranks have no checkpointer)."""


class SplitLifecycle(DistributedLifecycle):
    """The rollouts generated ahead ride in checkpoints; stopping tells the rollout group too."""

    def __init__(self, *args: Any, links: SplitLinks, service: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.links, self.service = links, service  # service: a rollout rank's RolloutService
        self.buffered_for_save = 0

    def states(self) -> dict[str, Any]:
        return {**super().states(), "buffered_steps": _BufferedSteps(self)}

    def rank_files(self, step: int) -> dict[str, bytes] | None:
        """Every trainer rank: its rows of the next steps, already generated (from weights that are gone)."""
        self.buffered_for_save = 0
        last = min(step + self.cfg.algorithm.max_staleness, self.cfg.trainer.total_steps)
        if not self.seat.trains or last <= step:
            return None
        intake, expected = self.links.intake, len(self.seat.rows)
        for future in range(step + 1, last + 1):
            intake.fill(future, expected, self.ctx.timeout_seconds,  # type: ignore[union-attr]
                        lambda have, future=future: self.stages.undelivered(future, have, expected))
        batches = [b for s in range(step + 1, last + 1) for b in intake.pending[s]]  # type: ignore[union-attr]
        self.buffered_for_save = last - step
        return {BUFFER_FILE: RolloutBatch.concat(batches).to_ipc()}

    def after_resume(self, path: Path, run: dict[str, Any], read_shared: Any = None) -> None:
        """Each trainer rank takes its rows of the checkpointed rollouts, whatever world wrote them."""
        resume = self.links.resume
        resume.step, resume.buffered_steps = int(run["step"]), int(run.get("buffered_steps") or 0)
        if not self.seat.trains or not resume.buffered_steps:
            return
        files = sorted(Path(path).glob(f"rank*/{BUFFER_FILE}")) + sorted(Path(path).glob(BUFFER_FILE))
        batch = RolloutBatch.concat([RolloutBatch.from_ipc(f.read_bytes()) for f in files])  # older: one shared file
        mine = self.seat.rank
        self.links.intake.restore(  # type: ignore[union-attr]
            batch, lambda b: self.links.owners(self.cfg, self.roles, b, world=self.seat.world) == mine)

    def resume_weights(self, version: int) -> None:
        if self.seat.trains:
            self.stages.send(version)
        elif self.service is not None:
            self.service.receive()

    def resize_margin(self) -> int:
        return self.cfg.algorithm.max_staleness + 2

    def stop_services(self) -> None:
        """Best effort: tell the rollout (and remote role) ranks to stop, never waiting long on them."""
        super().stop_services()
        if self.cfg.algorithm.max_staleness > 0 and self.links.intake is not None:
            self.links.intake.shutdown()  # unblocks a rollout waiting on this rank's full buffer
        if not self.seat.is_leader or "rollout" not in self.ctx.sync_groups:
            return
        self.settle_sync()
        header = stop_header(self.roles.device)
        work = dist.broadcast(header, src=self.ctx.env.rank, group=self.ctx.sync_groups["rollout"], async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=5))
        except RuntimeError as err:
            log.warning("rollout ranks did not take the stop message: %s", err)

    def settle_sync(self) -> None:
        """At the end: the last weight sync crossed, or a warning after a short wait (receivers gone)."""
        if self.links.sender is None:
            return
        try:
            self.links.sender.settle(timeout=timedelta(seconds=5))
        except RuntimeError as err:
            log.warning("the last weight sync did not finish: %s", err)

    def close(self) -> None:
        self.settle_sync()
        super().close()
        self.links.close()
