"""Split: the rollout group generates on devices of its own; rollouts reach the trainers over Arrow Flight.

Why this shape: rollout ranks generate slices of the step's prompt groups and put each row
straight to the Flight server of the trainer rank that trains it (intake.py: no rank-0
funnel). Each trainer rank files what it receives by step; with `max_staleness: k` the
rollout runs k steps ahead, and the batches a rank has not yet trained on are part of its
checkpoint. After the update the actor's weights are broadcast to the rollout group in
buckets. Each rollout is stamped with the policy version it came from.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl_hpc.data.layout import even_owner, even_slices, row_owner
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.placement.distributed import DistributedPlacement
from verl_hpc.runtime.placement.one_process import Timer, generate_rows
from verl_hpc.runtime.step import validation
from verl_hpc.runtime.step.metrics import sync_metrics
from verl_hpc.transport.rollouts.intake import BUFFER_FILE, RolloutRouter, TrainerIntake, bind_host, positions
from verl_hpc.transport.weights.bucketed import (
    STOP_VERSION,
    engine_buffer,
    join_send_gathers,
    push_weights,
    receive_weights,
    send_header,
    send_plan,
    stop_header,
)
from verl_hpc.transport.weights.sender import WeightSender
from verl_hpc.transport.weights.shard import ShardReceiver, send_shards, shard_sendable
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


class _BufferedSteps:
    """How many steps of rollouts a checkpoint carries (run_state.json's `buffered_steps`)."""

    def __init__(self, owner: Split):
        self.owner = owner

    def state_dict(self) -> int:
        return self.owner.buffered_for_save

    def load_state_dict(self, value: int) -> None:
        """Applied in `after_resume`, which every rank runs (serving ranks have no checkpointer)."""


class Split(DistributedPlacement):
    name = "split"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.resume_step = 0
        self.buffered_steps = 0      # after a resume: steps whose rollouts came from the checkpoint
        self.buffered_for_save = 0
        self.intake: TrainerIntake | None = None   # every trainer rank: its endpoint, its rows by step
        self.router: RolloutRouter | None = None   # every rollout rank: a client per trainer rank
        self.sent_bytes = 0    # rollout rank: the Arrow bytes of this step's batch, for serve_metrics
        self.sent_version = 0  # ... and the policy version that sampled it
        self.sender: WeightSender | None = None  # the leader's: every weight sync goes through it
        self.connect()
        if self.trains and self.ctx.sync_groups.get("rollout") is not None:
            actor = self.roles.actor
            self.sender = WeightSender(actor.model, actor.optimizer)  # type: ignore[union-attr]
            self.sync_overlapped = self.sender.overlaps
            if self.sender.overlaps:
                log.info("the actor's parameters are one flat buffer: weight syncs send views, no packing, "
                         "and overlap the next step until its optimizer step")
        self.own_rows = self.trains and self.ctx.shard_link is not None and \
            shard_sendable(self.roles.actor.model)  # type: ignore[union-attr]
        if self.own_rows:
            log.info("weight syncs: every trainer rank sends its own rows to the rollout, no gather")
        self.shards: ShardReceiver | None = None  # the first rollout rank's, made at its first sync

    def connect(self) -> None:
        """Every trainer rank serves Flight; every rollout rank learns all their addresses and connects."""
        from verl_hpc.transport.secret import read_run_secret

        ctx = self.ctx
        token = read_run_secret(self.run_dir)
        mine: tuple[int, str, str | None] | None = None
        if self.trains:
            self.intake = TrainerIntake(bind_host(ctx.env.master_addr, self.is_leader), token, capacity=8)
            mine = (self.rank, self.intake.location, self.intake.local_location)
        everyone: list[Any] = [None] * dist.get_world_size(ctx.control_group)
        dist.all_gather_object(everyone, mine, group=ctx.control_group)
        endpoints = sorted((x for x in everyone if x is not None), key=lambda x: x[0])
        if ctx.is_role("rollout"):
            self.router = RolloutRouter([e[1] for e in endpoints], token, f"rollout{ctx.rank_in_group}",
                                        [e[2] for e in endpoints])

    # --- trainer side ------------------------------------------------------------------------------
    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        """This rank's rows of the step, as the producers sent them here: nothing passes through rank 0."""
        with timer("wait_rollout"):
            batch = self.intake.take(round_key(step, round_), len(self.rows()), self.ctx.timeout_seconds,  # type: ignore[union-attr]
                                     lambda have: self.undelivered(step, have, len(self.rows())))
            self.check_staleness(batch, policy_version, step)
        return self.score(batch, timer)

    def intake_metrics(self) -> dict[str, float]:
        """Rank 0's own intake (the number that must fall as O(batch / W)), the largest rank's, the total.

        Every trainer rank calls it (two reductions). Rollouts restored from a checkpoint count 0."""
        mine = self.intake.counters()  # type: ignore[union-attr]
        keys = sorted(mine)
        values = torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64)
        largest, total = self.reduce_max(values), self.reduce_sum(values)
        out = {f"perf/rollout_intake_{k}": float(mine[k]) for k in keys}
        out.update({f"perf/rollout_intake_{k}_max_rank": float(v) for k, v in zip(keys, largest, strict=True)})
        out.update({f"perf/rollout_intake_{k}_total": float(v) for k, v in zip(keys, total, strict=True)})
        return out

    def undelivered(self, step: int, have: int, expected: int) -> str:
        ctx = self.ctx
        ranks = ctx.plan.group_ranks(ctx.plan.group_of_role("rollout").name)
        return (f"step {step}: trainer rank {self.rank} got {have} of its {expected} rollouts within "
                f"timeout_seconds={ctx.timeout_seconds:g}; rollout rank(s) {ranks} did not deliver "
                "(hint: see logs/rollout_rank*.out)")

    def check_staleness(self, batch: RolloutBatch, policy_version: int, step: int) -> None:
        """Every trainer rank raises alike: the largest lag over all of them decides."""
        own = policy_version - min(batch.column("policy_version").to_pylist(), default=policy_version)
        lag = int(self.reduce_max(torch.tensor([own], dtype=torch.float64))[0])
        if lag > self.cfg.algorithm.max_staleness:
            raise RuntimeError(f"step {step}: a rollout is {lag} policy versions old, above "
                               f"algorithm.max_staleness={self.cfg.algorithm.max_staleness}")

    def sync_weights(self, version: int, changed: bool) -> int:
        """Every step (the rollout ranks expect it) until the rollout has generated its last batch;
        after that only for a step that is validated (`validation_tail`)."""
        if self.trainer_step > self.last_needed() and not validation.due(self.cfg, self.trainer_step):
            return 0
        return self.send_split(version)

    def request_round(self, more: bool) -> None:
        group = self.ctx.sync_groups.get("rollout")
        if group is not None:  # the leader: the rollout ranks wait for the verdict
            verdict = torch.tensor([int(more)], dtype=torch.int64, device=self.roles.device)
            broadcast_kept(verdict, self.leader, group)

    def last_needed(self) -> int:
        """The last step whose weights the rollout needs for training rollouts."""
        return self.cfg.trainer.total_steps - self.cfg.algorithm.max_staleness - 1

    def validation_rollouts(self, step: int, policy_version: int) -> RolloutBatch:
        """The rollout group generated them with this step's weights and sent each rank its slice."""
        start, end = even_slices(self.validation_rows(), self.world, self.rank)
        return self.intake.take(val_key(step), end - start, self.ctx.timeout_seconds,  # type: ignore[union-attr]
                                lambda have: self.undelivered(step, have, end - start) + " (validation)")

    def validation_rows(self) -> int:
        return len(self.roles.val_prompt_ids or []) * self.cfg.trainer.val_n

    def owners(self, batch: RolloutBatch, validation: bool = False, world: int | None = None) -> np.ndarray:
        """The trainer rank of each row (of `world`, default: every trainer rank this rollout rank
        sends to): the training layout's, or validation's even slices."""
        where = positions(batch, self.cfg.algorithm.sampling.n)
        world = world if world is not None else len(self.router.clients)  # type: ignore[union-attr]
        if validation:
            return even_owner(where, self.validation_rows(), world)
        size = self.cfg.trainer.batch_size
        return row_owner(where, size, self.cfg.algorithm.mini_batch_size or size, world)

    def send_split(self, version: int) -> int:
        group = self.ctx.sync_groups.get("rollout")
        if self.own_rows:  # the leader's header, then every trainer rank's rows at once (shard_sync.py)
            model = self.roles.actor.model  # type: ignore[union-attr]
            if group is not None:
                send_header(model, group, self.leader, version)
            return send_shards(model, send_plan(model), self.ctx.shard_link)  # type: ignore[arg-type]
        if group is None:  # not the leader: only join the FSDP gathers the leader's send needs
            join_send_gathers(self.roles.actor.model)  # type: ignore[union-attr]
            return 0
        return self.sender.send(group, self.leader, version, self.ctx.weight_relay)  # type: ignore[union-attr]

    def resume_weights(self, version: int) -> None:
        if self.trains:
            self.send_split(version)
        elif self.ctx.is_role("rollout"):
            self.receive_split()

    def resize_margin(self) -> int:
        return self.cfg.algorithm.max_staleness + 2

    # --- checkpointed rollouts (max_staleness > 0) --------------------------------------------------
    def extra_states(self) -> dict[str, Any]:
        return {**super().extra_states(), "buffered_steps": _BufferedSteps(self)}

    def extra_rank_files(self, step: int) -> dict[str, bytes] | None:
        """Every trainer rank: its rows of the next steps, already generated (from weights that are gone)."""
        self.buffered_for_save = 0
        last = min(step + self.cfg.algorithm.max_staleness, self.cfg.trainer.total_steps)
        if not self.trains or last <= step:
            return None
        expected = len(self.rows())
        for future in range(step + 1, last + 1):
            self.intake.fill(future, expected, self.ctx.timeout_seconds,  # type: ignore[union-attr]
                             lambda have, future=future: self.undelivered(future, have, expected))
        batches = [b for s in range(step + 1, last + 1) for b in self.intake.pending[s]]  # type: ignore[union-attr]
        self.buffered_for_save = last - step
        return {BUFFER_FILE: RolloutBatch.concat(batches).to_ipc()}

    def after_resume(self, path: Path, run: dict[str, Any], read_shared: Any = None) -> None:
        """Each trainer rank takes its rows of the checkpointed rollouts, whatever world wrote them."""
        self.resume_step = int(run["step"])
        self.buffered_steps = int(run.get("buffered_steps") or 0)
        if not self.trains or not self.buffered_steps:
            return
        files = sorted(Path(path).glob(f"rank*/{BUFFER_FILE}")) + sorted(Path(path).glob(BUFFER_FILE))
        batch = RolloutBatch.concat([RolloutBatch.from_ipc(f.read_bytes()) for f in files])  # older: one shared file
        self.intake.restore(batch, lambda b: self.owners(b, world=self.world) == self.rank)  # type: ignore[union-attr]

    # --- rollout side --------------------------------------------------------------------------------
    def serve(self, step: int, indices: list[int], timer: Timer) -> bool:
        if not self.ctx.is_role("rollout"):
            return super().serve(step, indices, timer)
        self.heartbeat.enter(f"step {step} rollout")
        if not self.serve_rollout(step, indices, timer):
            return False
        return step < self.cfg.trainer.total_steps or self.validation_tail()

    def serve_rollout(self, step: int, indices: list[int], timer: Timer) -> bool:
        lag = self.cfg.algorithm.max_staleness
        if step <= self.resume_step + self.buffered_steps:
            return True  # this step's rollouts were restored from the checkpoint
        if step > self.resume_step + lag + 1:
            with timer("update_weights"):
                if self.receive_split() == STOP_VERSION:
                    return False
            self.put_validation(step - lag - 1)  # these weights are trainer step (step - lag - 1)'s
        elif step == 1:
            self.put_validation(0)
        n = self.cfg.algorithm.sampling.n
        start, end = even_slices(len(indices), self.ctx.group.size, self.ctx.rank_in_group)
        rows = [g * n + j for g in range(start, end) for j in range(n)]
        with timer("gen"):
            batch = generate_rows(self.roles, self.cfg, step, indices, rows, self.roles.engine.policy_version)  # type: ignore[union-attr]
        with timer("send"):
            try:
                self.sent_bytes = self.router.put(batch, self.owners(batch))  # type: ignore[union-attr]
            except Exception:  # the trainer shut its server down: a stop
                return False
        self.sent_version = self.roles.engine.policy_version  # type: ignore[union-attr]
        return not self.cfg.algorithm.filter_groups.enable or self.serve_rounds(step, rows)

    def serve_metrics(self, timer: Timer) -> dict[str, float]:
        """The rollout rank's view: generation and send seconds, the weights it received, the
        rollout bytes it sent (and at what rate), and which policy version sampled them."""
        out = super().serve_metrics(timer)
        if not self.ctx.is_role("rollout"):
            return out
        out.update(sync_metrics(self.last_sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0)))
        send_s = timer.seconds.get("timing_s/send", 0.0)
        out["perf/rollout_transport_bytes"] = float(self.sent_bytes)
        out["perf/rollout_transport_gbps"] = self.sent_bytes / send_s / 1e9 if self.sent_bytes and send_s > 0 else 0.0
        if self.sent_bytes:  # a step restored from the checkpoint sent nothing
            out["rollout/policy_version"] = float(self.sent_version)
        self.sent_bytes = 0
        return out

    def serve_rounds(self, step: int, rows: list[int]) -> bool:
        """Dynamic sampling: another round of new prompts as long as the leader asks for one."""
        group = self.ctx.sync_groups["rollout"]
        round_ = 0
        while True:
            verdict = torch.zeros(1, dtype=torch.int64, device=self.roles.device)
            broadcast_kept(verdict, self.leader, group)
            if not int(verdict.item()):
                return True
            round_ += 1
            indices = self.sampler.next_indices()
            batch = generate_rows(self.roles, self.cfg, round_key(step, round_), indices, rows,
                                  self.roles.engine.policy_version)  # type: ignore[union-attr]
            try:
                self.router.put(batch, self.owners(batch))  # type: ignore[union-attr]
            except Exception:  # the trainer shut its server down: a stop
                return False

    def validation_tail(self) -> bool:
        """After its last training batch: the weights of each later validated step, validated."""
        first = max(self.last_needed() + 1, self.resume_step + 1)
        for trained in range(first, self.cfg.trainer.total_steps + 1):
            if validation.due(self.cfg, trained):
                if self.receive_split() == STOP_VERSION:
                    return False
                self.put_validation(trained)
        return True

    def put_validation(self, trained: int) -> None:
        """Rollout ranks: their slice of the validation prompts, if `trained` is a validated step."""
        if not validation.due(self.cfg, trained):
            return
        self.heartbeat.enter(f"step {trained} validation")
        total = len(self.roles.val_prompt_ids or [])
        start, end = even_slices(total, self.ctx.group.size, self.ctx.rank_in_group)
        batch = validation.validation_rows(self.roles, self.cfg, start, end,
                                           self.roles.engine.policy_version, val_key(trained))  # type: ignore[union-attr]
        if len(batch):
            try:
                self.router.put(batch, self.owners(batch, validation=True))  # type: ignore[union-attr]
            except Exception:  # the trainer shut its server down: a stop, seen at the next receive
                log.info("validation rows for step %d not delivered: the trainer stopped", trained)

    def receive_split(self) -> int:
        """The newest weights into the engine; returns their version (STOP_VERSION: stop)."""
        engine = self.roles.engine
        specs = engine.weight_specs()  # type: ignore[union-attr]
        if self.shards is None and self.ctx.shard_links is not None:
            self.shards = ShardReceiver([shape for _, shape in specs], self.ctx.shard_links)
        version, tensors = receive_weights(specs, self.ctx.sync_groups["rollout"], self.leader, device=self.roles.device,
                                           into=engine_buffer(engine), relay=self.ctx.weight_relay, shards=self.shards)
        if version != STOP_VERSION:
            self.last_sync_bytes = push_weights(tensors, engine, version)
            engine.policy_version = version  # type: ignore[union-attr]
        return version

    def stop_services(self) -> None:
        """Best effort: tell the rollout (and remote role) ranks to stop, never waiting long on them."""
        super().stop_services()
        if self.cfg.algorithm.max_staleness > 0 and self.intake is not None:
            self.intake.shutdown()  # unblocks a rollout waiting on this rank's full buffer
        if not self.is_leader or "rollout" not in self.ctx.sync_groups:
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
        if self.sender is None:
            return
        try:
            self.sender.settle(timeout=timedelta(seconds=5))
        except RuntimeError as err:
            log.warning("the last weight sync did not finish: %s", err)

    def close(self) -> None:
        self.settle_sync()
        super().close()
        if self.router is not None:
            self.router.close()
        if self.intake is not None:
            self.intake.shutdown()
