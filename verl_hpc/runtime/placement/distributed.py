"""What every multi-process placement shares: one world, a group per role, trainer reductions.

Why a base class: colocated and split placements differ only in where generation runs and
how weights reach the engines. Summing statistics over the trainer ranks, agreeing on a
stop, naming a stalled rank, reaching the reference/critic/reward groups and exporting the
sharded policy are the same for both, and live here once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.config import RunConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.build import DTYPES, Roles, load_causal_lm
from verl_hpc.runtime.placement.one_process import Placement, Timer
from verl_hpc.runtime.placement.remote import RoleClient, RoleService
from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.runtime.process.heartbeat import (
    PULSE_SECONDS,
    STALE_PULSES,
    Heartbeat,
    StallError,
    is_peer_lost,
    is_timeout,
)
from verl_hpc.runtime.process.signals import StopFlag
from verl_hpc.runtime.state import resize
from verl_hpc.utils.collective import all_reduce_kept

SERVICE_SEED_OFFSET = {"rollout": 1000, "ref": 2000, "reward": 3000, "critic": 4000}


class DistributedPlacement(Placement):
    name = "distributed"

    def __init__(self, cfg: RunConfig, run_dir: Path, roles: Roles, ctx: DistContext, heartbeat: Heartbeat):
        trainer_size = ctx.plan.groups[0].size
        super().__init__(cfg, run_dir, roles, world=trainer_size,
                         rank=ctx.rank_in_group if ctx.is_role("actor") else 0)
        self.ctx, self.heartbeat = ctx, heartbeat
        self.leader = ctx.plan.group_ranks(ctx.plan.groups[0].name)[0]
        self.clients = {name: RoleClient(name, group, self) for name, group in ctx.exchange_groups.items()
                        if ctx.is_role("actor") and name in ("ref", "reward", "critic")}
        self.trainer_step = 0
        self.service = RoleService(ctx.group.name, ctx.exchange_groups[ctx.group.name], self) \
            if ctx.group.name in ("ref", "reward", "critic") else None

    @property
    def trains(self) -> bool:
        return self.ctx.is_role("actor")

    @property
    def world_size_of_run(self) -> int:
        return self.ctx.env.world_size

    def seed_stream(self) -> int:
        return SERVICE_SEED_OFFSET.get(self.ctx.group.name, 0) + self.ctx.rank_in_group

    def speaker(self) -> tuple[str, int, int] | None:
        ctx = self.ctx
        if ctx.env.rank == self.leader:
            return ("trainer", ctx.env.rank, 0)
        if self.trains or ctx.rank_in_group != 0:
            return None
        return (ctx.group.name, ctx.env.rank, [g.name for g in ctx.plan.groups].index(ctx.group.name))

    # --- stages whose role may live in another group -------------------------------------------
    def score(self, batch: RolloutBatch, timer: Timer) -> RolloutBatch | None:
        if "reward" in self.clients:
            with timer("reward"):
                scores = self.clients["reward"].call(batch)
            return None if scores is None else batch.with_columns(score=torch.tensor(scores, dtype=torch.float32))
        return super().score(batch, timer)

    def ref_logprobs(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if "ref" in self.clients:
            return self.clients["ref"].call_tokens(batch, inputs["response_mask"])
        return super().ref_logprobs(batch, inputs)

    def values(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if "critic" in self.clients:
            return self.clients["critic"].call_tokens(batch, inputs["response_mask"])
        return super().values(batch, inputs)

    def update_critic(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
        if "critic" in self.clients:
            return self.clients["critic"].update(batch, inputs)
        return super().update_critic(batch, inputs)

    def extra_states(self) -> dict[str, Any]:
        """A critic group's LR schedule rides in run_state.json through the trainer leader."""
        return {"critic_scheduler": self.clients["critic"]} if "critic" in self.clients else {}

    def serve(self, step: int, indices: list[int], timer: Timer) -> bool:
        if self.service is None:
            raise RuntimeError(f"group {self.ctx.group.name!r} has nothing to serve")
        return self.service.serve_step(step, timer)

    def serve_validation(self, step: int) -> bool:
        """A reward group scores the validation rows too: one exchange more, after the step's."""
        if self.service is not None and self.service.role == "reward":
            return self.service.serve_step(step)
        return True

    def stop_services(self) -> None:
        for client in self.clients.values():
            client.stop()

    # --- reductions over the trainer ranks ---------------------------------------------------------
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        out = tensor.detach().clone()
        all_reduce_kept(out, group=self.ctx.process_group)
        return out

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        out = tensor.detach().clone()
        all_reduce_kept(out, dist.ReduceOp.MAX, self.ctx.process_group)
        return out

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each rank's metrics are its pre-scaled share (roles/actor.py): a plain mean is the global value."""
        if self.world == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        all_reduce_kept(values, group=self.ctx.process_group)
        return {k: float(v) / self.world for k, v in zip(keys, values, strict=True)}

    def gather_to_all(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, value, group=self.ctx.process_group)
        return parts

    def gather_to_leader(self, value: Any) -> list[Any] | None:
        if self.world == 1:
            return [value]
        parts: list[Any] = [None] * self.world if self.is_leader else []
        dist.gather_object(value, parts if self.is_leader else None, dst=self.leader, group=self.ctx.process_group)
        return parts if self.is_leader else None

    def share_from_leader(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.ctx.control_group)
        return box[0]

    # --- the run around the step ---------------------------------------------------------------------
    def agree(self, stop: StopFlag) -> tuple[int | None, bool]:
        self.heartbeat.enter(f"step {self.trainer_step} agree")
        signum = stop.agreed(self.ctx.process_group)
        return signum, not signum and self.resize_agreed()

    def resize_agreed(self) -> bool:
        """Whether the leader saw a resize request (docs/elastic.md); not so near the end that a
        serving rank may already have finished its last step and stopped listening."""
        last = self.cfg.trainer.total_steps - self.resize_margin()
        if self.trainer_step > last:
            return False
        flag = torch.tensor([int(self.is_leader and resize.pending(self.run_dir))])
        if self.world > 1:
            all_reduce_kept(flag, dist.ReduceOp.MAX, self.ctx.process_group)
        return bool(flag.item())

    def resize_margin(self) -> int:
        return 1

    def guard(self, step: int, fn):
        self.trainer_step = step
        try:
            return fn()
        except (RuntimeError, TimeoutError, ConnectionError) as err:
            if not (is_timeout(err) or is_peer_lost(err)):
                raise
            what = "timed out" if is_timeout(err) else "lost a peer"
            settle = 0.0 if is_timeout(err) else STALE_PULSES * PULSE_SECONDS + 1.0  # let its pulse go stale
            raise StallError(f"step {step} {what} on {self.ctx.group.name} rank {self.ctx.env.rank}: "
                             f"{str(err).splitlines()[0][:300]} -- {self.heartbeat.describe_stall(settle)}") from err

    def barrier(self, name: str) -> None:
        self.ctx.barrier(name)

    def export_model(self) -> torch.nn.Module | None:
        """An unsharded copy of the actor on the leader, gathered one parameter at a time."""
        from verl_hpc.config.checks import expand_path
        from verl_hpc.roles.rollout import HFRolloutEngine
        from verl_hpc.transport.weights.bucketed import gather_only, stream_into

        engine = self.roles.engine
        if isinstance(engine, HFRolloutEngine) and self.ctx.is_role("rollout"):  # colocated: already synced
            return engine.model if self.is_leader else None
        if self.world == 1 and self.roles.actor.dp_group is None:  # type: ignore[union-attr]
            return self.roles.actor.model  # type: ignore[union-attr]
        if not self.is_leader:
            gather_only(self.roles.actor.model)  # type: ignore[union-attr]
            return None
        target = load_causal_lm(str(expand_path(self.cfg.model.path)), DTYPES[self.cfg.model.dtype])
        stream_into(self.roles.actor.model, target)  # type: ignore[union-attr]
        return target

    def close(self) -> None:
        super().close()
