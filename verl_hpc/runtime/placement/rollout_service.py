"""A split run's rollout ranks: take the newest weights, generate a slice of the step, send each row home.

Why a service of its own: a rollout rank runs no trainer step; step after step it receives
weights (k steps behind with `max_staleness: k`), samples its even slice of the step's
prompt groups and puts every row to the trainer rank that trains it (split.py's intake).
With dynamic sampling it serves more rounds while the leader asks; after its last training
batch it still generates the validation rows of every later validated step.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_hpc.config import RunConfig
from verl_hpc.data.layout import even_slices
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.metrics import memory_metrics
from verl_hpc.runtime.build import Roles
from verl_hpc.runtime.placement.one_process import generate_rows
from verl_hpc.runtime.placement.split import SplitLinks, last_needed, round_key, val_key
from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.runtime.process.heartbeat import Heartbeat
from verl_hpc.runtime.step import validation
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.metrics import sync_metrics
from verl_hpc.transport.weights.bucketed import STOP_VERSION, engine_buffer, push_weights
from verl_hpc.transport.weights.receiver import BucketReceiver
from verl_hpc.utils.collective import broadcast_kept
from verl_hpc.utils.logging import get_logger

log = get_logger("placement")


class RolloutService:
    def __init__(self, cfg: RunConfig, roles: Roles, ctx: DistContext, heartbeat: Heartbeat, links: SplitLinks):
        self.cfg, self.roles, self.ctx, self.heartbeat, self.links = cfg, roles, ctx, heartbeat, links
        self.leader = ctx.plan.group_ranks(ctx.plan.groups[0].name)[0]
        self.weights = BucketReceiver(ctx.weight_links(), roles.device)
        self.last_sync_bytes = 0
        self.sent_bytes = 0    # the Arrow bytes of this step's batch, for serve_metrics
        self.sent_version = 0  # ... and the policy version that sampled it
        self.next_sync: int | None = None  # the trainer step whose weights the next sync carries
        self.stopped = False  # a stop arrived between two rounds (partial rollouts)
        self.validating = False  # validation rows are being generated: no weights are taken meanwhile
        if roles.agent is not None and cfg.rollout.multi_turn.partial_rollouts:
            roles.agent.loop.refresh_weights = self.between_rounds

    @property
    def engine(self) -> Any:
        return self.roles.engine

    def serve(self, step: int, indices: list[int], timer: Timer, sampler: PromptSampler) -> bool:
        self.heartbeat.enter(f"step {step} rollout")
        if not self.serve_rollout(step, indices, timer, sampler):
            return False
        return step < self.cfg.trainer.total_steps or self.validation_tail()

    def serve_rollout(self, step: int, indices: list[int], timer: Timer, sampler: PromptSampler) -> bool:
        lag, resume = self.cfg.algorithm.max_staleness, self.links.resume
        if self.next_sync is None:
            self.next_sync = resume.step + 1
        if step <= resume.step + resume.buffered_steps:
            return True  # this step's rollouts were restored from the checkpoint
        if self.stopped:
            return False
        if step > resume.step + lag + 1:
            due = step - lag - 1  # these weights are trainer step (step - lag - 1)'s
            if self.next_sync <= due:  # not already taken between two rounds of the last step
                with timer("update_weights"):
                    if self.receive() == STOP_VERSION:
                        return False
                self.next_sync = due + 1
            self.put_validation(due)
        elif step == 1:
            self.put_validation(0)
        n = self.cfg.algorithm.sampling.n
        start, end = even_slices(len(indices), self.ctx.group.size, self.ctx.rank_in_group)
        rows = [g * n + j for g in range(start, end) for j in range(n)]
        with timer("gen"):
            batch = generate_rows(self.roles, self.cfg, step, indices, rows, self.engine.policy_version)
        with timer("send"):
            try:
                self.sent_bytes = self.links.router.put(  # type: ignore[union-attr]
                    batch, self.links.owners(self.cfg, self.roles, batch))
            except Exception:  # the trainer shut its server down: a stop
                return False
        self.sent_version = self.engine.policy_version
        return not self.cfg.algorithm.filter_groups.enable or self.serve_rounds(step, rows, sampler)

    def serve_metrics(self, timer: Timer) -> dict[str, float]:
        """The rollout rank's view: generation and send seconds, the weights it received, the
        rollout bytes it sent (and at what rate), and which policy version sampled them."""
        out = {**timer.seconds, **memory_metrics(self.roles.device)}
        out.update(sync_metrics(self.last_sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0)))
        send_s = timer.seconds.get("timing_s/send", 0.0)
        out["perf/rollout_transport_bytes"] = float(self.sent_bytes)
        out["perf/rollout_transport_gbps"] = self.sent_bytes / send_s / 1e9 if self.sent_bytes and send_s > 0 else 0.0
        if self.sent_bytes:  # a step restored from the checkpoint sent nothing
            out["rollout/policy_version"] = float(self.sent_version)
        self.sent_bytes = 0
        return out

    def serve_validation(self, step: int) -> bool:
        """The rollout group's validation rows went out with the weights (`put_validation`)."""
        return True

    def serve_rounds(self, step: int, rows: list[int], sampler: PromptSampler) -> bool:
        """Dynamic sampling: another round of new prompts as long as the leader asks for one."""
        group = self.ctx.sync_groups["rollout"]
        round_ = 0
        while True:
            verdict = torch.zeros(1, dtype=torch.int64, device=self.roles.device)
            broadcast_kept(verdict, self.leader, group)
            if not int(verdict.item()):
                return True
            round_ += 1
            indices = sampler.next_indices()
            batch = generate_rows(self.roles, self.cfg, round_key(step, round_), indices, rows,
                                  self.engine.policy_version)
            try:
                self.links.router.put(batch, self.links.owners(self.cfg, self.roles, batch))  # type: ignore[union-attr]
            except Exception:  # the trainer shut its server down: a stop
                return False

    def validation_tail(self) -> bool:
        """After its last training batch: the weights of each later validated step, validated."""
        first = max(last_needed(self.cfg) + 1, self.links.resume.step + 1)
        for trained in range(first, self.cfg.trainer.total_steps + 1):
            if validation.due(self.cfg, trained):
                if self.receive() == STOP_VERSION:
                    return False
                self.put_validation(trained)
        return True

    def put_validation(self, trained: int) -> None:
        """This rank's slice of the validation prompts, if `trained` is a validated step."""
        if not validation.due(self.cfg, trained):
            return
        self.heartbeat.enter(f"step {trained} validation")
        total = len(self.roles.val_prompt_ids or [])
        start, end = even_slices(total, self.ctx.group.size, self.ctx.rank_in_group)
        self.validating = True  # every validation turn from these weights: none taken between its rounds
        try:
            batch = validation.validation_rows(self.roles, self.cfg, start, end, self.engine.policy_version,
                                               val_key(trained))
        finally:
            self.validating = False
        if len(batch):
            try:
                self.links.router.put(  # type: ignore[union-attr]
                    batch, self.links.owners(self.cfg, self.roles, batch, validation=True))
            except Exception:  # the trainer shut its server down: a stop, seen at the next receive
                log.info("validation rows for step %d not delivered: the trainer stopped", trained)

    def between_rounds(self, version: int) -> int:
        """Partial rollouts: the trainer's newer weights, if they have arrived, before the next round.

        Why here: a turn sampled from fresher weights is less off-policy, and the episodes in
        flight need not wait for a step boundary to get them. A sync whose step is validated
        is left for the boundary, where its validation rows are generated with exactly those
        weights, and none is taken while validation rows are generated. A stop ends the step's
        serving at its boundary. Past the last step whose weights generate a batch no sync is
        certain to come, so none is waited for (`arrived` posts a receive).
        """
        trained = self.next_sync
        if self.stopped or self.validating or trained is None or trained > last_needed(self.cfg) \
                or validation.due(self.cfg, trained):
            return version
        if not self.weights.arrived():
            return version
        if self.receive() == STOP_VERSION:
            self.stopped = True
            return version
        self.next_sync = trained + 1
        log.debug("weights of trainer step %d taken between rounds (policy version %d)", trained,
                  self.engine.policy_version)
        return int(self.engine.policy_version)

    def receive(self) -> int:
        """The newest weights into the engine; returns their version (STOP_VERSION: stop)."""
        engine = self.engine
        version, tensors = self.weights.receive(engine.weight_specs(), into=engine_buffer(engine))
        if version != STOP_VERSION:
            self.last_sync_bytes = push_weights(tensors, engine, version)
            engine.policy_version = version
        return version
