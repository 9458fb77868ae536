"""Start, checkpoint and stop for the distributed trainer: everything around the step.

Why a separate mixin: the step loop (dist_trainer.py) reads as the algorithm; resuming
(which ranks load what, and how the engines get the restored weights), deciding when
to save, and telling the other roles to stop are lifecycle concerns with their own
protocol, documented in docs/checkpoints.md.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.roles.allocator import ResourceAllocator
from verl_hpc.roles.weight_sync import (
    STOP_VERSION,
    broadcast_weights,
    engine_buffer,
    gather_only,
    iter_full_params,
    push_weights,
    receive_weights,
)
from verl_hpc.runtime import resize
from verl_hpc.runtime.checkpointing import RunCheckpointer, build_manager, resume_path
from verl_hpc.runtime.dist_roles import STOP_PAYLOAD
from verl_hpc.utils.logging import get_logger

log = get_logger("dist_trainer")
BUFFER_FILE = "rollout_buffer.arrow"  # rollouts generated ahead (max_staleness > 0), Arrow IPC


class DistLifecycle:
    """Mixed into DistributedTrainer; uses its cfg, ctx, roles, sampler, step, policy_version."""

    def make_checkpointer(self) -> RunCheckpointer:
        ctx = self.ctx
        manager = build_manager(self.cfg, self.run_dir, process_group=ctx.process_group,
                                async_group=ctx.checkpoint_group)
        sizes = {g.name: g.size for g in ctx.plan.groups}
        return RunCheckpointer(self.cfg, self.run_dir, manager, sizes, self.is_leader, ctx.process_group)

    def resume(self) -> int:
        """Trainer ranks load the checkpoint; every rank learns the step, version and data order.

        Then the engines get the restored weights once (split: a broadcast that the rollout
        expects before its first step; colocated: streamed), after which the normal schedule
        continues — so a resumed on-policy run samples exactly what the original did.
        """
        ctx, cfg = self.ctx, self.cfg
        info: list[Any] = [None]
        if self.is_leader:
            path = resume_path(cfg, self.run_dir)
            info = [str(path) if path else None]
        dist.broadcast_object_list(info, src=ctx.plan.group_ranks("trainer")[0], group=ctx.control_group)
        if info[0] is None:
            return 0
        run: list[Any] = [None]
        if self.checkpointer is not None:
            run = [self.checkpointer.restore(Path(info[0]), self.sampler, self.roles.actor, self.roles.critic)]
        if self.is_leader and run[0].get("buffered_steps"):
            self.load_buffered_rollouts(self.checkpointer.manager.read_shared(Path(info[0]), BUFFER_FILE))
        dist.broadcast_object_list(run, src=ctx.plan.group_ranks("trainer")[0], group=ctx.control_group)
        state = run[0]
        self.step, self.policy_version = state["step"], state["policy_version"]
        self.buffered_steps = int(state.get("buffered_steps", 0))
        if self.checkpointer is None:
            self.sampler.load_state_dict(state["sampler"])
        if self.roles.engine is not None and not self.split:
            push_weights(iter_full_params(self.roles.actor.model), self.roles.engine, self.policy_version)
        elif self.split and ctx.is_role("actor"):
            self.send_split()
        elif self.split and ctx.is_role("rollout"):
            self.receive_split()
        if self.roles.engine is not None:
            self.roles.engine.policy_version = self.policy_version
        return self.step

    def send_split(self) -> int:
        """Trainer ranks: the actor's weights to the split rollout group; returns the bytes sent."""
        group = self.ctx.sync_groups.get("rollout")
        if group is None:  # not the leader: only join the FSDP gathers the leader's send needs
            gather_only(self.roles.actor.model)
            return 0
        leader = self.ctx.plan.group_ranks("trainer")[0]
        return broadcast_weights(self.roles.actor.model, group, leader, self.policy_version, True)[1]

    def receive_split(self) -> tuple[int, int]:
        """Rollout ranks: the newest weights into the engine; returns (version, bytes) or (STOP_VERSION, 0)."""
        engine, leader = self.roles.engine, self.ctx.plan.group_ranks("trainer")[0]
        version, tensors = receive_weights(engine.weight_specs(), self.ctx.sync_groups["rollout"], leader,
                                           device=self.roles.device, into=engine_buffer(engine))
        if version == STOP_VERSION:
            return version, 0
        return version, push_weights(tensors, engine, version)

    def maybe_save(self, metrics: dict[str, float]) -> None:
        ckpt = self.checkpointer
        if ckpt is None or not ckpt.due(self.step):
            return
        final = self.step == self.cfg.trainer.total_steps or ckpt.requested
        buffered, data = self.buffered_rollouts() if self.is_leader else (0, None)
        ckpt.save(self.step, self.policy_version, self.sampler, self.roles.actor, self.roles.critic,
                  block=True if final else None, extra_state={"buffered_steps": buffered},
                  extra_files={BUFFER_FILE: data} if data else None)
        if self.is_leader:
            metrics["timing_s/save_checkpoint"] = ckpt.save_seconds

    def make_allocators(self) -> ResourceAllocator:
        """Generation retries per rank (no collective inside); training retries only on a lone trainer.

        Why not across FSDP ranks: one rank's OOM leaves the others waiting in a collective
        that rank will never join, so there the error is raised with the numbers instead.
        """
        trainer = self.cfg.trainer
        if self.roles.actor is not None:
            self.roles.actor.allocator = ResourceAllocator(self.roles.device, trainer.min_micro_batch_size,
                                                           trainer.oom_retry and self.ctx.group.size == 1)
        return ResourceAllocator(self.roles.device, trainer.min_micro_batch_size, trainer.oom_retry)

    def resize_agreed(self) -> bool:
        """Trainer ranks: whether the leader saw a resize request (docs/elastic.md).

        Only the leader reads the run directory (one stat per step); a MAX all-reduce gives
        every trainer rank its answer. Not near the end: a split rollout that has generated its
        last batch no longer listens for the stop message (it would wait at the final barrier),
        so a request that late stays pending and the run simply finishes.
        """
        last = self.cfg.trainer.total_steps - (self.cfg.algorithm.max_staleness + 2 if self.split else 1)
        if self.step > last:
            return False
        flag = torch.tensor([int(self.is_leader and resize.pending(self.run_dir))])
        if dist.get_world_size(self.ctx.process_group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.process_group)
        return bool(flag.item())

    def stop_for_resize(self) -> str:
        """After the step's checkpoint: stop every role, hand the request to the launcher."""
        self.stop_others()
        if self.is_leader:  # the checkpoint was saved blocking (requested): it is committed
            resize.accept(self.run_dir, self.step)
        return resize.RESIZE_REASON

    def save_hf_model(self) -> None:
        """The trained actor as a Hugging Face directory (every trainer rank joins the gathers)."""
        from verl_hpc.checkpoint.hf_export import save_hf_directory
        from verl_hpc.config.checks import expand_path
        from verl_hpc.runtime.components import DTYPES

        model = self.roles.export_model(str(expand_path(self.cfg.model.path)), DTYPES[self.cfg.model.dtype],
                                        self.is_leader)
        if model is not None:
            save_hf_directory(model, self.roles.tokenizer, self.run_dir / "hf_model")
            log.info("saved %s", self.run_dir / "hf_model")

    def stop_others(self) -> None:
        """Best effort: tell the reward and rollout ranks to stop, never waiting long on them."""
        ctx, roles = self.ctx, self.roles
        if not self.is_leader:
            return
        if "reward" in ctx.sync_groups:
            dist.broadcast_object_list([STOP_PAYLOAD], src=ctx.env.rank, group=ctx.sync_groups["reward"])
        if "rollout" in ctx.sync_groups:
            if self.cfg.algorithm.max_staleness > 0 and roles.flight_server is not None:
                roles.flight_server.shutdown()  # unblocks a rollout waiting on a full buffer
            header = torch.tensor([STOP_VERSION, 0, 0], dtype=torch.int64, device=roles.device)
            work = dist.broadcast(header, src=ctx.env.rank, group=ctx.sync_groups["rollout"], async_op=True)
            try:
                work.wait(timeout=timedelta(seconds=5))
            except RuntimeError as err:
                log.warning("rollout ranks did not take the stop message: %s", err)

