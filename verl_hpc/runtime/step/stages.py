"""The narrow interfaces a step runs against, and the one typed object its data travels in.

Why three small interfaces instead of one placement object: the loop (loop.py) asks
*what* happens in a step — rollouts, reference and old log-probs, values, the critic's and
the actor's updates, the weight sync — and never *where*; the statistics it needs over
the trainer ranks are a separate concern (`Collectives`), and so is everything around the
step (resume, checkpoint state, stop, shutdown: `Lifecycle`). Each placement
(runtime/placement/) implements them; a serving rank (a rollout, ref, critic or reward
group of its own) implements `Service` instead of `Stages`.

Why `StepData`: every stage reads the step's rows and what earlier stages added, and adds
one thing. A stage returns what it adds; the loop stores it in its typed field, so a
reader sees at one glance which stage wrote which column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from verl_hpc.data.layout import rank_rows
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.actor import UpdatePlan
from verl_hpc.runtime.step.counters import Timer

if TYPE_CHECKING:
    from verl_hpc.config import RunConfig
    from verl_hpc.data.prompts import PromptSampler
    from verl_hpc.runtime.build import Roles
    from verl_hpc.runtime.process.signals import StopFlag

ADDED = ("advantages", "returns", "token_rewards", "ref_logprobs", "old_logprobs", "values")


@dataclass
class StepData:
    """This rank's rows of one step, as model inputs, and every per-token column a stage added."""

    batch: RolloutBatch
    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask, response_mask: from the batch, never changed
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def response_mask(self) -> torch.Tensor:
        return self.inputs["response_mask"]

    def added(self) -> dict[str, torch.Tensor]:
        """The columns the stages added so far (what a recorded rollout carries), in `ADDED` order."""
        return {name: getattr(self, name) for name in ADDED if getattr(self, name) is not None}

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the roles' forward and update passes read: the inputs and every added column."""
        return {**self.inputs, **self.added()}


@dataclass
class ActorUpdate:
    metrics: dict[str, float]
    first_logprobs: torch.Tensor | None = None  # the update's first forward: the trainer's view of the samples


@dataclass
class SyncReport:
    bytes: int = 0            # what this rank moved
    overlapped: bool = False  # the sync may still cross while the next step runs


@dataclass
class Seat:
    """Who this process is in the run: whether it trains, its trainer rank, its rows of a step."""

    trains: bool
    rank: int                  # data-parallel trainer rank (0 on serving ranks)
    world: int                 # data-parallel trainer ranks
    stream: int                # its random stream: every draw is seeded from (seed, step, stream)
    rows: list[int]            # its rows of every step (data/layout.py)
    plan: UpdatePlan           # how it cuts them into mini- and micro-batches
    speaker: tuple[str, int, int] | None = ("trainer", 0, 0)  # (role, global rank, group index) if it logs
    processes: int = 1         # every process of the run

    @property
    def is_leader(self) -> bool:
        """Trainer rank 0: logs, commits checkpoints, coordinates."""
        return self.trains and self.rank == 0

    def lay_out(self, cfg: RunConfig, batch_size: int) -> None:
        """Its rows and plan for a step of `batch_size` rows: `trainer.batch_size`, or fewer for the one
        step where dynamic sampling ran out of informative groups (step/dynamic_sampling.py)."""
        self.rows, self.plan = seat_layout(cfg, batch_size, self.world, self.rank)


def seat_layout(cfg: RunConfig, batch_size: int, world: int, rank: int) -> tuple[list[int], UpdatePlan]:
    """A trainer rank's rows of a step of `batch_size` rows and how it cuts them (data/layout.py).

    A step smaller than one mini-batch is one mini-batch of all its rows."""
    mini = min(cfg.algorithm.mini_batch_size or batch_size, batch_size)
    return rank_rows(batch_size, mini, world, rank), UpdatePlan.from_config(cfg.algorithm, batch_size, world)


class Collectives(Protocol):
    """Statistics and agreements over the trainer ranks (identities in one process)."""

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]: ...

    def gather_to_all(self, value: Any) -> list[Any]: ...

    def gather_to_leader(self, value: Any) -> list[Any] | None: ...

    def share_from_leader(self, value: Any) -> Any:
        """The trainer leader's `value` on every process of the run."""
        ...

    def barrier(self, name: str) -> None:
        """Every process of the run."""
        ...


class Stages(Protocol):
    """What the loop calls on a trainer rank, one method per stage, the actor like every role."""

    def step_data(self, batch: RolloutBatch) -> StepData: ...

    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        """This rank's rows of the step (its `round_`-th generation round with dynamic sampling),
        scored, in row order; None: the run is stopping."""
        ...

    def next_round(self, more: bool) -> None:
        """Dynamic sampling: whether another generation round of this step follows."""
        ...

    def intake_metrics(self) -> dict[str, float]:
        """What this step's rollouts cost the trainer side to take in ({} where nothing crossed a wire)."""
        ...

    def ref_logprobs(self, data: StepData) -> torch.Tensor: ...

    def needs_old_logprobs(self, data: StepData) -> bool:
        """Whether the actor's update needs them before it starts (several mini-batches or epochs)."""
        ...

    def old_logprobs(self, data: StepData) -> torch.Tensor: ...

    def values(self, data: StepData) -> torch.Tensor: ...

    def update_critic(self, data: StepData) -> dict[str, float]: ...

    def update_actor(self, data: StepData) -> ActorUpdate: ...

    def sync_weights(self, version: int, changed: bool, step: int) -> SyncReport: ...

    def validation_rollouts(self, step: int, policy_version: int) -> RolloutBatch: ...

    def score_validation(self, batch: RolloutBatch) -> RolloutBatch: ...

    def role_metrics(self) -> dict[str, float]:
        """What the roles of this rank say about themselves after a step (memory, retries, reward)."""
        ...

    def memory_boundary(self, data: StepData) -> dict[str, float]:
        """After a step, on every trainer rank: its measured peaks beside the memory plan's estimate
        for the step's shape; a plan proved wrong re-plans here (runtime/step/memory.py)."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class Service(Protocol):
    """A serving rank's part of every step: rollouts for the trainers, or ref/critic/reward answers."""

    def serve(self, step: int, indices: list[int], timer: Timer, sampler: PromptSampler) -> bool:
        """This rank's part of `step`; False once the trainers said stop."""
        ...

    def serve_metrics(self, timer: Timer) -> dict[str, float]: ...

    def serve_validation(self, step: int) -> bool: ...


class Lifecycle(Protocol):
    """The run around the step: what it checkpoints and restores, how it stops and shuts down."""

    def states(self) -> dict[str, Any]:
        """Placement-held run state to checkpoint (the split's buffered rollouts, a critic group's schedule)."""
        ...

    def rank_files(self, step: int) -> dict[str, bytes] | None:
        """Files this trainer rank adds to its part of checkpoint `step`."""
        ...

    def after_resume(self, path: Path, run: dict[str, Any], read_shared: Any = None) -> None: ...

    def resume_weights(self, version: int) -> None:
        """After a restore: engines holding a copy get the restored weights once."""
        ...

    def agree(self, stop: StopFlag) -> tuple[int | None, bool]:
        """(the stop signal every trainer rank acts on, whether a resize was requested)."""
        ...

    def guard(self, step: int, fn: Callable[[], dict[str, float] | None]) -> dict[str, float] | None:
        """Run one step; a distributed placement turns a hang into an error naming the suspect."""
        ...

    def record(self, step: int, batch: RolloutBatch) -> None: ...

    def export_model(self) -> torch.nn.Module | None:
        """The trained policy, whole, on the leader (every trainer rank must call it)."""
        ...

    def stop_services(self) -> None:
        """Trainer side: tell every serving rank to leave its loop (best effort)."""
        ...

    def close(self) -> None: ...


@dataclass
class Placement:
    """One process's part of the run: who it is, and the interfaces the loop and lifecycle use."""

    name: str
    roles: Roles
    seat: Seat
    collectives: Collectives
    lifecycle: Lifecycle
    stages: Stages | None = None    # trainer ranks
    service: Service | None = None  # serving ranks
