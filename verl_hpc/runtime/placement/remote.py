"""A role on processes of its own: the trainers send rows, the role's group sends results back.

Why over an exchange group (every trainer rank + the role's ranks): each trainer rank
holds its own rows of the step, so none of them has to funnel the batch through rank 0.
Rows travel as Arrow record batches (the data plane's format); each serving rank takes an
even slice of the step's rows in row order, computes, and answers per row position, so
the numbers do not depend on how many trainer or serving ranks there are.

One exchange per step and role, in the loop's order (reward, ref, critic values, critic
update): a serving rank
knows what comes next from the config. A trainer-side `stop()` sends "stop" instead of
rows, and the serving ranks leave their loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl_hpc.config import RunConfig
from verl_hpc.data.layout import even_slices, rank_rows, row_position
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.metrics import memory_metrics
from verl_hpc.metrics.memory import process_probe
from verl_hpc.roles.actor import UpdatePlan
from verl_hpc.roles.forward import batched_logprobs, to_device
from verl_hpc.roles.reward import scored
from verl_hpc.runtime.build import Roles
from verl_hpc.runtime.process.dist import DistContext
from verl_hpc.runtime.process.heartbeat import Heartbeat
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.utils.collective import all_reduce_kept

STOP = "stop"
# The optional columns each role reads (the ids, prompts and responses always travel): the rest
# stay home. The reward's text fields are the dataset's; the critic's update adds its targets.
# An agent episode's reward reads its whole conversation (`trajectory`); the loss mask always travels.
READS = {"reward": ("ground_truth", "ground_truth_json", "data_source", "extra_info", "trajectory"), "ref": (),
         "critic": ()}


class Exchange:
    """The trainer ranks' payloads to the serving ranks, and the serving ranks' answers back.

    Why not one all-gather each way: with one serving rank (the common reward or ref group)
    an all-gather hands every trainer rank every other trainer's rows, and the serving rank
    the trainers' empty answers, two object collectives that each cost a size round and a
    data round. A gather to the serving rank and a broadcast from it move only what is
    read (measured on gloo, 2 ranks: 2.1 against 3.2 ms per request and answer). Several
    serving ranks each need every row, so there it stays an all-gather. The group's ranks
    are the trainers first, then the serving ranks (runtime/process/dist.py).
    """

    def __init__(self, group: dist.ProcessGroup, trainers: int):
        self.group, self.trainers = group, trainers

    @property
    def single(self) -> bool:
        return dist.get_world_size(self.group) - self.trainers == 1

    def to_serving(self, payload: Any) -> list[Any]:
        """Every trainer rank's payload, on each serving rank (what trainer ranks get is unused)."""
        if not self.single:
            return _all_gather(self.group, payload)
        me = dist.get_rank(self.group)
        parts: list[Any] | None = [None] * (self.trainers + 1) if me == self.trainers else None
        dist.gather_object(payload, parts, group=self.group, group_dst=self.trainers)
        return parts or []

    def to_trainers(self, answer: Any) -> list[Any]:
        """Every serving rank's answer, on each trainer rank (trainer ranks pass None)."""
        if not self.single:
            return _all_gather(self.group, answer)[self.trainers:]
        box = [answer]
        dist.broadcast_object_list(box, group=self.group, group_src=self.trainers)
        return box


def _all_gather(group: dist.ProcessGroup, payload: Any) -> list[Any]:
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, payload, group=group)
    return parts


def _positions(batch: RolloutBatch, n: int) -> list[int]:
    return [row_position(g, s, n) for g, s in zip(batch.column("group_id").to_pylist(),
                                                  batch.column("sample_index").to_pylist(), strict=True)]


class RoleClient:
    """Trainer side of one remote role."""

    def __init__(self, role: str, group: dist.ProcessGroup, cfg: RunConfig, trainers: int):
        self.role, self.group, self.cfg = role, group, cfg
        self.exchange = Exchange(group, trainers)
        self.scheduler_state: dict[str, Any] | None = None  # critic: its LR schedule, for run_state.json

    def state_dict(self) -> dict[str, Any] | None:
        return self.scheduler_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The critic ranks restore their own schedule from the shared run state."""
        self.scheduler_state = state

    def call(self, batch: RolloutBatch) -> list[Any] | None:
        """Per-row results for this rank's rows, in their order."""
        self.exchange.to_serving(batch.only(READS[self.role]).to_ipc())
        answers = self.exchange.to_trainers(None)
        merged: dict[int, Any] = {}
        for part in answers:
            if part:
                merged.update(part)
        n = self.cfg.algorithm.sampling.n
        return [merged[pos] for pos in _positions(batch, n)]

    def call_tokens(self, batch: RolloutBatch, like: torch.Tensor) -> torch.Tensor:
        """A per-token result ([B, R], zero past each response) for this rank's rows."""
        rows = self.call(batch) or []
        out = torch.zeros_like(like, dtype=torch.float32)
        for i, values in enumerate(rows):
            out[i, :len(values)] = torch.from_numpy(np.asarray(values, dtype=np.float32))
        return out

    def update(self, batch: RolloutBatch, returns: torch.Tensor, values: torch.Tensor) -> dict[str, float]:
        """Critic: the rows' returns and old values to the critic group, which trains; its metrics back."""
        rows = batch.with_columns(returns=returns, values=values).only(("returns", "values"))
        self.exchange.to_serving(rows.to_ipc())
        answers = self.exchange.to_trainers(None)
        answer = next(a for a in answers if isinstance(a, dict) and "metrics" in a)
        self.scheduler_state = answer["scheduler"]
        return answer["metrics"]

    def stop(self) -> None:
        try:
            self.exchange.to_serving(STOP)
        except RuntimeError as err:  # best effort: a dead serving rank must not hide the stop's cause
            from verl_hpc.utils.logging import get_logger

            get_logger("placement").warning("the %s group did not take the stop message: %s", self.role, err)


class RoleService:
    """The serving side: the reference model's logprobs or the reward's scores, step after step."""

    def __init__(self, cfg: RunConfig, roles: Roles, ctx: DistContext, heartbeat: Heartbeat, trainers: int):
        self.cfg, self.roles, self.ctx, self.heartbeat, self.trainers = cfg, roles, ctx, heartbeat, trainers
        self.role = ctx.group.name
        self.exchange = Exchange(ctx.exchange_groups[self.role], trainers)

    def serve(self, step: int, indices: list[int], timer: Timer, sampler: PromptSampler) -> bool:
        return self.serve_step(step, timer)

    def serve_metrics(self, timer: Timer) -> dict[str, float]:
        """What a serving rank says about its part of a step: its stage seconds, memory and reward's own."""
        reward = self.roles.reward
        extra = reward.metrics() if self.role == "reward" and reward is not None else {}
        return {**timer.seconds, **memory_metrics(self.roles.device), **process_probe().take(), **extra}

    def serve_validation(self, step: int) -> bool:
        """A reward group scores the validation rows too: one exchange more, after the step's."""
        return self.serve_step(step) if self.role == "reward" else True

    def serve_step(self, step: int, timer: Timer | None = None) -> bool:
        """This role's exchanges of one step (the critic: values, then its update); False on stop.

        `timer` gets `wait_<kind>` (for the trainers' rows) and `<kind>` (computing and answering)."""
        timer = timer or Timer()
        for kind in ("values", "update") if self.role == "critic" else (self.role,):
            self.heartbeat.enter(f"step {step} {self.role} {kind}")
            with timer(f"wait_{kind}"):
                parts = self.exchange.to_serving(None)
            if any(part == STOP for part in parts):
                return False
            with timer(kind):
                full = RolloutBatch.concat([RolloutBatch.from_ipc(part) for part in parts if part]).sorted_by_row()
                self.exchange.to_trainers(self.update(full) if kind == "update" else self.per_row(full))
        return True

    def serving_ranks(self) -> int:
        return dist.get_world_size(self.exchange.group) - self.trainers

    def per_row(self, full: RolloutBatch) -> dict[int, Any]:
        """An even slice of the step's rows, computed here, answered by row position."""
        start, end = even_slices(len(full), self.serving_ranks(), self.ctx.rank_in_group)
        mine = full.take(list(range(start, end)))
        results = self.compute(mine) if len(mine) else []
        return dict(zip(_positions(mine, self.cfg.algorithm.sampling.n), results, strict=True))

    def compute(self, batch: RolloutBatch) -> list[Any]:
        roles, algo, ctx = self.roles, self.cfg.algorithm, self.ctx
        if self.role == "reward":  # each row's score, and the judge's verdict when a judge scores
            out = scored(batch, roles.reward)
            return list(zip(out.scores().tolist(), out.column("judge_verdict").to_pylist(), strict=True))
        inputs = to_device(batch.model_inputs(roles.pad_id), roles.device)
        micro = algo.micro_batch_size or len(batch)
        budget = algo.token_budget
        if self.role == "critic":
            out = roles.critic.compute_values(inputs, micro, budget)  # type: ignore[union-attr]
        else:
            sharded = ctx.group.size > 1 and ctx.group.resources.strategy == "fsdp"
            with roles.ref_offload.resident():
                out = batched_logprobs(roles.ref_model, inputs, algo.sampling.temperature, micro,
                                       self.cfg.model.logprob_chunk_tokens, budget,
                                       ctx.process_group if sharded else None, self.cfg.model.remove_padding)
        lengths = batch.response_lengths()
        values = out.float().cpu().numpy()
        return [values[i, :lengths[i]].tolist() for i in range(len(batch))]

    def update(self, full: RolloutBatch) -> dict[str, Any] | None:
        """The critic group trains on its rows of every mini-batch (data/layout.py), like any trainer."""
        cfg, ctx, roles = self.cfg, self.ctx, self.roles
        world, batch_size = self.serving_ranks(), len(full)  # fewer than trainer.batch_size when DAPO ran out
        mini = min(cfg.algorithm.mini_batch_size or batch_size, batch_size)
        mine = full.take(rank_rows(batch_size, mini, world, ctx.rank_in_group))
        inputs = to_device(mine.model_inputs(roles.pad_id), roles.device)
        width = inputs["response_mask"].shape[1]
        for key in ("returns", "values"):
            inputs[key] = mine.token_tensor(key, width).to(roles.device)
        metrics = roles.critic.update(inputs, UpdatePlan.from_config(cfg.algorithm, batch_size, world))  # type: ignore[union-attr]
        if world > 1:
            keys = sorted(metrics)
            values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
            all_reduce_kept(values, group=ctx.process_group)
            metrics = {k: float(v) / world for k, v in zip(keys, values, strict=True)}
        if ctx.rank_in_group != 0:
            return None
        return {"metrics": metrics, "scheduler": roles.critic.scheduler.state_dict()}  # type: ignore[union-attr]
