"""What every multi-process placement shares: one world, a group per role, trainer reductions.

Why a base: colocated and split placements differ only in where generation runs and how
weights reach the engines. Reaching the reference/critic/reward groups (stages), agreeing
on a stop, naming a stalled rank and exporting the sharded policy (lifecycle) are the same
for both, and live here once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from verl_hpc.config import RunConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.build import DTYPES, Roles, load_causal_lm
from verl_hpc.runtime.placement.collectives import GroupCollectives
from verl_hpc.runtime.placement.one_process import LocalLifecycle, LocalStages, trainer_seat
from verl_hpc.runtime.placement.remote import RoleClient
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
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.stages import Seat
from verl_hpc.utils.collective import all_reduce_kept

SERVICE_SEED_OFFSET = {"rollout": 1000, "ref": 2000, "reward": 3000, "critic": 4000}


def distributed_seat(cfg: RunConfig, ctx: DistContext) -> Seat:
    """Trainer ranks train their rows; a serving rank draws from its role's own random stream."""
    trains = ctx.is_role("actor")
    leader = ctx.plan.group_ranks(ctx.plan.groups[0].name)[0]
    if ctx.env.rank == leader:
        speaker: tuple[str, int, int] | None = ("trainer", ctx.env.rank, 0)
    elif trains or ctx.rank_in_group != 0:
        speaker = None
    else:
        speaker = (ctx.group.name, ctx.env.rank, [g.name for g in ctx.plan.groups].index(ctx.group.name))
    return trainer_seat(cfg, world=ctx.plan.groups[0].size, rank=ctx.rank_in_group if trains else 0,
                        stream=SERVICE_SEED_OFFSET.get(ctx.group.name, 0) + ctx.rank_in_group, speaker=speaker,
                        processes=ctx.env.world_size, trains=trains)


def role_clients(cfg: RunConfig, ctx: DistContext) -> dict[str, RoleClient]:
    """A trainer rank's clients of the ref, reward and critic groups the plan has."""
    trainers = ctx.plan.groups[0].size
    return {name: RoleClient(name, group, cfg, trainers) for name, group in ctx.exchange_groups.items()
            if ctx.is_role("actor") and name in ("ref", "reward", "critic")}


class DistributedStages(LocalStages):
    """A trainer rank: its own roles, except those on a group of their own (reached by a client)."""

    def __init__(self, cfg: RunConfig, roles: Roles, seat: Seat, collectives: GroupCollectives,
                 clients: dict[str, RoleClient]):
        super().__init__(cfg, roles, seat, collectives)
        self.clients = clients

    def score(self, batch: RolloutBatch, timer: Timer) -> RolloutBatch | None:
        if "reward" in self.clients:
            with timer("reward"):
                answers = self.clients["reward"].call(batch)
            if answers is None:
                return None
            verdicts = [verdict for _, verdict in answers]
            columns: dict[str, Any] = {"score": torch.tensor([score for score, _ in answers], dtype=torch.float32)}
            if any(v is not None for v in verdicts):
                columns["judge_verdict"] = pa.array(verdicts, pa.string())
            return batch.with_columns(**columns)
        return super().score(batch, timer)

    def ref_logprobs(self, data: Any) -> torch.Tensor:
        if "ref" in self.clients:
            return self.clients["ref"].call_tokens(data.batch, data.response_mask)
        return super().ref_logprobs(data)

    def values(self, data: Any) -> torch.Tensor:
        if "critic" in self.clients:
            return self.clients["critic"].call_tokens(data.batch, data.response_mask)
        return super().values(data)

    def update_critic(self, data: Any) -> dict[str, float]:
        if "critic" in self.clients:
            return self.clients["critic"].update(data.batch, data.returns, data.values)
        return super().update_critic(data)


class DistributedLifecycle(LocalLifecycle):
    """Agreement over the trainer group, stall naming, the sharded export, stopping the role groups."""

    def __init__(self, cfg: RunConfig, run_dir: Path, roles: Roles, seat: Seat, stages: Any,
                 ctx: DistContext, heartbeat: Heartbeat, clients: dict[str, RoleClient]):
        super().__init__(cfg, run_dir, roles, seat, stages)
        self.ctx, self.heartbeat, self.clients = ctx, heartbeat, clients
        self.trainer_step = 0

    def states(self) -> dict[str, Any]:
        """A critic group's LR schedule rides in run_state.json through the trainer leader."""
        return {"critic_scheduler": self.clients["critic"]} if "critic" in self.clients else {}

    def resume_weights(self, version: int) -> None:
        if self.seat.trains:  # serving ranks (ref, critic, reward groups) hold no engine
            super().resume_weights(version)

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
        flag = torch.tensor([int(self.seat.is_leader and resize.pending(self.run_dir))])
        if self.seat.world > 1:
            all_reduce_kept(flag, dist.ReduceOp.MAX, self.ctx.process_group)
        return bool(flag.item())

    def resize_margin(self) -> int:
        return 1

    def guard(self, step: int, fn: Callable[[], dict[str, float] | None]) -> dict[str, float] | None:
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

    def export_model(self) -> torch.nn.Module | None:
        """An unsharded copy of the actor on the leader, gathered one parameter at a time."""
        from verl_hpc.roles.rollout import HFRolloutEngine
        from verl_hpc.transport.weights.bucketed import gather_only, stream_into
        from verl_hpc.utils.fs import expand_path

        engine, actor = self.roles.engine, self.roles.actor
        if isinstance(engine, HFRolloutEngine) and self.ctx.is_role("rollout"):  # colocated: already synced
            return engine.model if self.seat.is_leader else None
        if self.seat.world == 1 and actor.dp_group is None:  # type: ignore[union-attr]
            return actor.model  # type: ignore[union-attr]
        if not self.seat.is_leader:
            gather_only(actor.model)  # type: ignore[union-attr]
            return None
        target = load_causal_lm(str(expand_path(self.cfg.model.path)), DTYPES[self.cfg.model.dtype])
        stream_into(actor.model, target)  # type: ignore[union-attr]
        return target

    def stop_services(self) -> None:
        for client in self.clients.values():
            client.stop()
