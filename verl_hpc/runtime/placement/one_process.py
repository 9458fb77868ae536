"""The interface between the one RL loop and where its stages run.

Why an interface: the loop (runtime/loop.py) is the algorithm, the same code for one
process, a colocated hybrid engine and split groups. What differs between placements —
where generation runs, how rollouts reach the trainers, where the reference, critic and
reward forwards run, how weights reach the engines, how statistics are summed — is a
method here with one implementation per placement. The defaults are the one-process
answers: every role local, every reduction the identity.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import RunConfig
from verl_hpc.data.layout import even_slices, rank_rows
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.metrics import memory_metrics
from verl_hpc.roles.actor import UpdatePlan
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.roles.forward import batched_logprobs
from verl_hpc.roles.rollout.replay import is_replay, write_record
from verl_hpc.runtime.build import Roles
from verl_hpc.runtime.process.signals import StopFlag
from verl_hpc.runtime.step.baselines import add_greedy_baselines
from verl_hpc.runtime.step.validation import validation_rows


class Timer:
    """Collects `timing_s/<name>` for one step; `on_enter` hears each stage's name (heartbeat)."""

    def __init__(self, on_enter: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        yield
        key = f"timing_s/{name}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


def generate_rows(roles: Roles, cfg: RunConfig, step: int, indices: list[int], rows: list[int],
                  policy_version: int) -> RolloutBatch:
    """Sample the given rows of the step (row = group * n + sample), scored if a reward is local."""
    n = cfg.algorithm.sampling.n
    groups = [r // n for r in rows]
    samples = [r % n for r in rows]
    prompt_index = [indices[g] for g in groups]
    prompt_ids = [roles.prompt_ids[i] for i in prompt_index]
    engine = roles.engine
    if is_replay(engine):
        out = engine.replay(step, list(zip(groups, samples, prompt_index, strict=True)))  # type: ignore[union-attr]
    elif prompt_ids:
        out = generate_guarded(engine, prompt_ids, cfg.algorithm.sampling, roles.allocator)
    else:
        out = None
    dataset = roles.dataset
    batch = RolloutBatch.from_generation(
        prompt_ids, out.response_ids if out else [], out.logprobs if out else [], group_ids=groups,
        prompt_index=prompt_index, ground_truth=[dataset.answers[i] for i in prompt_index],
        policy_version=policy_version, step=step, sample_index=samples,
        data_source=[dataset.data_sources[i] for i in prompt_index],
        extra_info=[dataset.extra_infos[i] for i in prompt_index])
    if cfg.algorithm.estimator.greedy_baseline:  # before the rows' own scoring: its metrics are theirs
        batch = add_greedy_baselines(roles, cfg, batch)
    if roles.reward is not None and len(batch):
        batch = batch.with_columns(score=roles.reward.score(batch))
    return batch


class Placement:
    """One process's part of every stage. The base class is the one-process placement."""

    name = "single"

    def __init__(self, cfg: RunConfig, run_dir: Path, roles: Roles, world: int = 1, rank: int = 0):
        self.cfg, self.run_dir, self.roles = cfg, run_dir, roles
        self.world, self.rank = world, rank  # data-parallel trainer ranks, and this one's index
        self.last_sync_bytes = 0
        self.sync_overlapped = False  # a weight sync may still cross while the next step runs

    # --- who this process is -------------------------------------------------------------
    @property
    def trains(self) -> bool:
        """Whether this process runs the trainer's step (else it serves one role's part)."""
        return True

    @property
    def is_leader(self) -> bool:
        """Trainer rank 0: logs, commits checkpoints, coordinates."""
        return self.trains and self.rank == 0

    def seed_stream(self) -> int:
        """Which random stream this process draws from at each step (seeded from seed, step, stream)."""
        return self.rank

    def speaker(self) -> tuple[str, int, int] | None:
        """(role, global rank, group index) when this process writes metrics, else None: trainer
        rank 0 for the step, each serving group's first rank for its own part."""
        return ("trainer", 0, 0)

    def rows(self) -> list[int]:
        cfg = self.cfg
        batch = cfg.trainer.batch_size
        return rank_rows(batch, cfg.algorithm.mini_batch_size or batch, self.world, self.rank)

    def plan(self) -> UpdatePlan:
        return UpdatePlan.from_config(self.cfg.algorithm, self.cfg.trainer.batch_size, self.world)

    # --- the stages ------------------------------------------------------------------------
    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        """This rank's rows of the step (of its `round_`-th generation round with dynamic
        sampling), scored, in row order (None: the run is stopping)."""
        with timer("gen"):
            batch = generate_rows(self.roles, self.cfg, step, indices, self.rows(), policy_version)
        return self.score(batch, timer)

    def score(self, batch: RolloutBatch, timer: Timer) -> RolloutBatch | None:
        if batch.column("score").null_count and self.roles.reward is not None:
            with timer("reward"):
                batch = batch.with_columns(score=self.roles.reward.score(batch))
        return batch

    def ref_logprobs(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        plan, actor = self.plan(), self.roles.actor
        with self.roles.ref_offload.resident():
            return batched_logprobs(self.roles.ref_model, inputs, self.cfg.algorithm.sampling.temperature,
                                    plan.micro_batch_size, self.cfg.model.logprob_chunk_tokens, plan.token_budget,
                                    actor.dp_group if actor is not None else None,  # the ref shards with the actor
                                    self.cfg.model.remove_padding)

    def values(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        plan = self.plan()
        return self.roles.critic.compute_values(inputs, plan.micro_batch_size, plan.token_budget)  # type: ignore[union-attr]

    def update_critic(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.roles.critic.update(inputs, self.plan())  # type: ignore[union-attr]

    def sync_weights(self, version: int, changed: bool) -> int:
        """New actor weights into the engine(s); returns the bytes this rank moved.

        An FSDP actor (colocated) is gathered one parameter at a time, every rank joining.
        """
        from verl_hpc.roles.rollout import shares_module
        from verl_hpc.transport.weights.bucketed import iter_full_params, push_weights

        engine, actor = self.roles.engine, self.roles.actor
        if engine is None:  # DPO: no engine to feed
            return 0
        if shares_module(engine, actor.model):  # type: ignore[union-attr,arg-type]
            engine.policy_version = version  # type: ignore[union-attr]
            return 0
        if not changed:
            return 0
        return push_weights(iter_full_params(actor.model), engine, version)  # type: ignore[union-attr]

    def resume_weights(self, version: int) -> None:
        """After a restore: engines holding a copy get the restored weights once."""
        self.sync_weights(version, changed=True)

    # --- statistics over the trainer ranks -------------------------------------------------
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics

    def request_round(self, more: bool) -> None:
        """Dynamic sampling: whether another generation round of this step follows (split:
        the rollout group waits to hear it)."""

    def attach_sampler(self, sampler: Any) -> None:
        """The prompt sampler, for a rollout group that draws the prompts of extra rounds."""
        self.sampler = sampler

    def gather_to_all(self, value: Any) -> list[Any]:
        """Every trainer rank's `value`, in rank order, on every trainer rank."""
        return [value]

    def gather_to_leader(self, value: Any) -> list[Any] | None:
        """Every trainer rank's `value`, in rank order, on the leader (None elsewhere)."""
        return [value]

    def record(self, step: int, batch: RolloutBatch) -> None:
        if self.cfg.data.record_rollouts:
            write_record(self.run_dir, step, self.rank, batch)

    # --- the run around the step ----------------------------------------------------------
    def agree(self, stop: StopFlag) -> tuple[int | None, bool]:
        """(the stop signal every trainer rank acts on, whether a resize was requested)."""
        return stop.agreed(), False

    def guard(self, step: int, fn: Callable[[], dict[str, float] | None]) -> dict[str, float] | None:
        """Run one step; a distributed placement turns a hang into an error naming the suspect."""
        return fn()

    @property
    def world_size_of_run(self) -> int:
        return 1

    def share_from_leader(self, value: Any) -> Any:
        """The trainer leader's `value` on every process of the run."""
        return value

    def extra_states(self) -> dict[str, Any]:
        """Placement-held run state to checkpoint (the split rollout buffer)."""
        return {}

    def intake_metrics(self) -> dict[str, float]:
        """What this step's rollouts cost the trainer side to take in ({} where nothing crosses a wire)."""
        return {}

    def extra_rank_files(self, step: int) -> dict[str, bytes] | None:
        """Files this trainer rank adds to its part of checkpoint `step` (the split's rollouts ahead)."""
        return None

    def after_resume(self, path: Path, run: dict[str, Any], read_shared: Any = None) -> None:
        """What the placement restores beyond the states (rollouts generated ahead)."""

    def barrier(self, name: str) -> None:
        """Every process of the run (none but this one here)."""

    def export_model(self) -> torch.nn.Module | None:
        """The trained policy, whole, on the leader (every trainer rank must call it)."""
        return self.roles.actor.model  # type: ignore[union-attr]

    # --- other ranks, stopping ---------------------------------------------------------------
    def serve(self, step: int, indices: list[int], timer: Timer) -> bool:
        """A non-trainer rank's part of `step`; False once the trainers said stop."""
        raise NotImplementedError(f"the {self.name} placement has no service ranks")

    def serve_metrics(self, timer: Timer) -> dict[str, float]:
        """What a serving rank says about its part of a step: its stage seconds and memory."""
        return {**timer.seconds, **memory_metrics(self.roles.device)}

    # --- validation (runtime/validation.py) -----------------------------------------------------
    def validation_rollouts(self, step: int, policy_version: int) -> RolloutBatch:
        """This trainer rank's validation rows, generated on its own engine."""
        total = len(self.roles.val_prompt_ids or [])
        start, end = even_slices(total, self.world, self.rank)
        return validation_rows(self.roles, self.cfg, start, end, policy_version, step)

    def score_validation(self, batch: RolloutBatch) -> RolloutBatch:
        """Scores for rows not scored where they were generated (every trainer rank calls it)."""
        scored = self.score(batch, Timer())
        if scored is None or (len(scored) and scored.column("score").null_count):
            raise RuntimeError("validation rows came back unscored")
        return scored

    def serve_validation(self, step: int) -> bool:
        """A non-trainer rank's part of the validation after `step` (runtime/validation.py: `due`)."""
        return True

    def stop_services(self) -> None:
        """Trainer side: tell every serving rank to leave its loop (best effort)."""

    def close(self) -> None:
        self.roles.close()
