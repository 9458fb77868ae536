"""Colocated (the hybrid engine): every trainer rank generates its own rows with its own engine.

Why no gather: a trainer rank samples exactly the rows it will train on (data/layout.py),
whole prompt groups when the estimator asks for them, so rollouts never leave the rank.
The engine wakes for generation only and gets the actor's new weights streamed into it
after each update (an FSDP actor is gathered one parameter at a time).
"""

from __future__ import annotations

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.placement.distributed import DistributedStages
from verl_hpc.runtime.placement.one_process import generate_rows
from verl_hpc.runtime.step.counters import Timer


class ColocatedStages(DistributedStages):
    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch | None:
        engine = self.roles.engine
        with timer("gen"):
            engine.wake_up()  # type: ignore[union-attr]
            batch = generate_rows(self.roles, self.cfg, step, indices, self.seat.rows, policy_version)
            engine.sleep()  # type: ignore[union-attr]
        return self.score(batch, timer)
