"""The one-process placement: every role here, every reduction the identity.

Why it is also the base of the others: a colocated trainer rank computes its reference,
values, critic and actor updates exactly as one process does, on its own rows; the
distributed placements (distributed.py, colocated.py, split.py) override only what moves
elsewhere (rows over the wire, a role on a group of its own, reductions over ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import RunConfig
from verl_hpc.data.layout import even_slices
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.metrics import memory_metrics
from verl_hpc.metrics.memory import GIB, process_probe
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.roles.forward import batched_logprobs, to_device
from verl_hpc.roles.reward import scored
from verl_hpc.roles.rollout.replay import is_replay, write_record
from verl_hpc.runtime.build import Roles
from verl_hpc.runtime.process.deadline import Agreement, TimeBudget, agree_max
from verl_hpc.runtime.step.baselines import add_greedy_baselines
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.memory import (
    MemoryWatch,
    apply_live,
    has_optimizer_state,
    live_switches,
    observed_shape,
)
from verl_hpc.runtime.step.stages import ActorUpdate, Placement, Seat, StepData, SyncReport, seat_layout
from verl_hpc.runtime.step.validation import validation_rows


def generate_rows(roles: Roles, cfg: RunConfig, step: int, indices: list[int], rows: list[int],
                  policy_version: int) -> RolloutBatch:
    """Sample the given rows of the step (row = group * n + sample), scored if a reward is local."""
    n = cfg.algorithm.sampling.n
    groups = [r // n for r in rows]
    samples = [r % n for r in rows]
    prompt_index = [indices[g] for g in groups]
    prompt_ids = [roles.prompt_ids[i] for i in prompt_index]
    engine = roles.engine
    if roles.agent is not None and prompt_ids and not is_replay(engine):  # each row an agent episode
        batch = roles.agent.rows(step, groups, samples, prompt_index, roles.dataset, cfg.algorithm.sampling,
                                 policy_version)
        return batch.with_columns(score=roles.reward.score(batch)) if roles.reward is not None else batch
    if is_replay(engine):
        out = engine.replay(step, list(zip(groups, samples, prompt_index, strict=True)))  # type: ignore[union-attr]
    elif prompt_ids:
        out = generate_guarded(engine, prompt_ids, cfg.algorithm.sampling, roles.allocator)
    else:
        out = None
    dataset = roles.dataset
    if out is not None and out.prompt_ids is not None:  # replayed agent episodes: the prompts they continued
        prompt_ids = out.prompt_ids
    batch = RolloutBatch.from_generation(
        prompt_ids, out.response_ids if out else [], out.logprobs if out else [], group_ids=groups,
        prompt_index=prompt_index, ground_truth=[dataset.ground_truths[i] for i in prompt_index],
        policy_version=policy_version, step=step, sample_index=samples,
        data_source=[dataset.data_sources[i] for i in prompt_index],
        extra_info=[dataset.extra_infos[i] for i in prompt_index], trajectory=out.trajectory if out else None)
    if cfg.algorithm.estimator.greedy_baseline:  # before the rows' own scoring: its metrics are theirs
        batch = add_greedy_baselines(roles, cfg, batch)
    if roles.reward is not None and len(batch):
        batch = scored(batch, roles.reward)
    return batch


def trainer_seat(cfg: RunConfig, world: int = 1, rank: int = 0, *, trains: bool = True, stream: int | None = None,
                 speaker: tuple[str, int, int] | None = ("trainer", 0, 0), processes: int = 1) -> Seat:
    """A rank's seat: its rows of every step and its update plan (data/layout.py)."""
    rows, plan = seat_layout(cfg, cfg.trainer.batch_size, world, rank)
    return Seat(trains=trains, rank=rank, world=world, stream=rank if stream is None else stream,
                rows=rows, plan=plan, speaker=speaker, processes=processes)


class LocalCollectives:
    """One trainer rank: every statistic is its own."""

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics

    def gather_to_all(self, value: Any) -> list[Any]:
        return [value]

    def gather_to_leader(self, value: Any) -> list[Any] | None:
        return [value]

    def share_from_leader(self, value: Any) -> Any:
        return value

    def barrier(self, name: str) -> None:
        """Nobody else to wait for."""


class LocalStages:
    """Every stage on this process's own roles (the defaults every placement starts from)."""

    def __init__(self, cfg: RunConfig, roles: Roles, seat: Seat, collectives: Any):
        self.cfg, self.roles, self.seat, self.collectives = cfg, roles, seat, collectives
        self.memory_watch: MemoryWatch | None = None  # model.memory_plan: auto (runtime/step/memory.py)

    @property
    def actor(self) -> Any:
        return self.roles.actor

    def step_data(self, batch: RolloutBatch) -> StepData:
        if self.memory_watch is not None:  # before this step's update: did the actor's optimizer hold state?
            self.memory_watch.optimizer_state = has_optimizer_state(self.roles.actor)
        return StepData(batch, to_device(batch.model_inputs(self.roles.pad_id), self.roles.device))

    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        with timer("gen"):
            batch = generate_rows(self.roles, self.cfg, step, indices, self.seat.rows, policy_version)
        return self.score(batch, timer)

    def score(self, batch: RolloutBatch, timer: Timer) -> RolloutBatch | None:
        if batch.column("score").null_count and self.roles.reward is not None:
            with timer("reward"):
                batch = scored(batch, self.roles.reward)
        return batch

    def next_round(self, more: bool) -> None:
        """The rows of every round are made here: nobody to tell."""

    def intake_metrics(self) -> dict[str, float]:
        return {}

    def ref_logprobs(self, data: StepData) -> torch.Tensor:
        plan, actor = self.seat.plan, self.actor
        with self.roles.ref_offload.resident():
            return batched_logprobs(self.roles.ref_model, data.inputs, self.cfg.algorithm.sampling.temperature,
                                    plan.micro_batch_size, self.cfg.model.logprob_chunk_tokens, plan.token_budget,
                                    actor.dp_group if actor is not None else None,  # the ref shards with the actor
                                    self.cfg.model.remove_padding)

    def needs_old_logprobs(self, data: StepData) -> bool:
        return self.actor.old_logprobs_needed(self.seat.plan, data.response_mask.shape[0])

    def old_logprobs(self, data: StepData) -> torch.Tensor:
        plan = self.seat.plan
        return self.actor.compute_logprobs(data.inputs, plan.micro_batch_size, plan.token_budget)

    def values(self, data: StepData) -> torch.Tensor:
        plan = self.seat.plan
        return self.roles.critic.compute_values(data.tensors(), plan.micro_batch_size,  # type: ignore[union-attr]
                                                plan.token_budget)

    def update_critic(self, data: StepData) -> dict[str, float]:
        return self.roles.critic.update(data.tensors(), self.seat.plan)  # type: ignore[union-attr]

    def update_actor(self, data: StepData) -> ActorUpdate:
        metrics = self.actor.update(data.tensors(), self.seat.plan)
        return ActorUpdate(metrics, self.actor.sampled_logprobs)

    def sync_weights(self, version: int, changed: bool, step: int) -> SyncReport:
        """New actor weights into the engine(s); an FSDP actor (colocated) is gathered one
        parameter at a time, every rank joining."""
        from verl_hpc.roles.rollout import shares_module
        from verl_hpc.transport.weights.bucketed import iter_full_params, push_weights

        engine = self.roles.engine
        if shares_module(engine, self.actor.model):  # type: ignore[arg-type]
            engine.policy_version = version  # type: ignore[union-attr]
            return SyncReport()
        if not changed:
            return SyncReport()
        return SyncReport(push_weights(iter_full_params(self.actor.model), engine, version))

    def validation_rollouts(self, step: int, policy_version: int) -> RolloutBatch:
        """This trainer rank's validation rows, generated on its own engine."""
        total = len(self.roles.val_prompt_ids or [])
        start, end = even_slices(total, self.seat.world, self.seat.rank)
        return validation_rows(self.roles, self.cfg, start, end, policy_version, step)

    def score_validation(self, batch: RolloutBatch) -> RolloutBatch:
        """Scores for rows not scored where they were generated (every trainer rank calls it)."""
        scored = self.score(batch, Timer())
        if scored is None or (len(scored) and scored.column("score").null_count):
            raise RuntimeError("validation rows came back unscored")
        return scored

    def role_metrics(self) -> dict[str, float]:
        allocator = self.actor.allocator
        allocator.probe()
        out = {**memory_metrics(self.roles.device), **allocator.metrics()}
        reward = self.roles.reward
        if reward is not None and hasattr(reward, "metrics"):
            out.update(reward.metrics())
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.roles.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def memory_boundary(self, data: StepData) -> dict[str, float]:
        measured = process_probe().take()
        watch = self.memory_watch
        if watch is None:
            return measured
        seen = observed_shape(data.inputs)
        step_peak = measured.get("memory/step_peak_gb", 0.0) * GIB

        def agree_max(value: float) -> float:
            return float(self.collectives.reduce_max(torch.tensor([value], dtype=torch.float64))[0])

        out = {**measured, **watch.estimate_metrics(seen), **live_switches(self.roles, self.seat.plan)}
        switches = watch.check(seen, step_peak, agree_max)
        if switches is not None:
            apply_live(self.cfg, self.roles, self.seat.plan, switches)
        return {**out, "memory/plan_replans": float(watch.replans)}


class LocalLifecycle:
    """One process: nothing to agree on, nobody to stop, the actor is the export."""

    def __init__(self, cfg: RunConfig, run_dir: Path, roles: Roles, seat: Seat, stages: Any = None):
        self.cfg, self.run_dir, self.roles, self.seat, self.stages = cfg, run_dir, roles, seat, stages

    def states(self) -> dict[str, Any]:
        return {}

    def rank_files(self, step: int) -> dict[str, bytes] | None:
        return None

    def after_resume(self, path: Path, run: dict[str, Any], read_shared: Any = None) -> None:
        """Nothing held beyond the checkpointed states."""

    def resume_weights(self, version: int) -> None:
        if self.stages is not None and self.roles.engine is not None:  # DPO: no engine to feed
            self.stages.sync_weights(version, True, 0)

    def agree(self, signum: int | None, budget: TimeBudget, abandoned: bool) -> Agreement:
        return agree_max(signum, budget, abandoned, None)

    def guard(self, step: int, fn: Callable[[], dict[str, float] | None]) -> dict[str, float] | None:
        return fn()

    def record(self, step: int, batch: RolloutBatch) -> None:
        if self.cfg.data.record_rollouts:
            write_record(self.run_dir, step, self.seat.rank, batch)

    def export_model(self) -> torch.nn.Module | None:
        return self.roles.actor.model  # type: ignore[union-attr]

    def stop_services(self) -> None:
        """No serving ranks."""

    def close(self) -> None:
        self.roles.close()


def one_process_placement(cfg: RunConfig, run_dir: Path, roles: Roles) -> Placement:
    seat = trainer_seat(cfg)
    collectives = LocalCollectives()
    stages = LocalStages(cfg, roles, seat, collectives) if roles.engine is not None else None
    return Placement("single", roles, seat, collectives, LocalLifecycle(cfg, run_dir, roles, seat, stages), stages)
