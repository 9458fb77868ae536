"""Colocated (the hybrid engine): every trainer rank generates its own rows with its own engine.

Why no gather: a trainer rank samples exactly the rows it will train on (data/layout.py),
whole prompt groups when the estimator asks for them, so rollouts never leave the rank.
The engine wakes for generation only and gets the actor's new weights streamed into it
after each update (an FSDP actor is gathered one parameter at a time).
"""

from __future__ import annotations

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.placement.base import Timer, generate_rows
from verl_hpc.runtime.placement.distributed import DistributedPlacement


class Colocated(DistributedPlacement):
    name = "colocated"

    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer) -> RolloutBatch | None:
        engine = self.roles.engine
        with timer("gen"):
            engine.wake_up()  # type: ignore[union-attr]
            batch = generate_rows(self.roles, self.cfg, step, indices, self.rows(), policy_version)
            engine.sleep()  # type: ignore[union-attr]
        return self.score(batch, timer)

    def resume_weights(self, version: int) -> None:
        if self.trains:  # serving ranks (ref, critic, reward groups) hold no engine
            self.sync_weights(version, changed=True)

    def sync_weights(self, version: int, changed: bool) -> int:
        from verl_hpc.roles.rollout import shares_module
        from verl_hpc.roles.weight_sync import iter_full_params, push_weights

        engine, actor = self.roles.engine, self.roles.actor
        if shares_module(engine, actor.model):  # type: ignore[union-attr,arg-type]
            engine.policy_version = version  # type: ignore[union-attr]
            return 0
        if not changed:
            return 0
        return push_weights(iter_full_params(actor.model), engine, version)  # type: ignore[union-attr]
