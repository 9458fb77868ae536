"""A role on processes of its own: the trainers send rows, the role's group sends results back.

Why over an exchange group (every trainer rank + the role's ranks): each trainer rank
holds its own rows of the step, so none of them has to funnel the batch through rank 0.
Rows travel as Arrow record batches (the data plane's format); each serving rank takes an
even slice of the step's rows in row order, computes, and answers per row position, so
the numbers do not depend on how many trainer or serving ranks there are.

One exchange per step and role, in the loop's order (reward, then ref): a serving rank
knows what comes next from the config. A trainer-side `stop()` sends "stop" instead of
rows, and the serving ranks leave their loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl_hpc.data.layout import even_slices, row_position
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.forward import batched_logprobs, to_device

if TYPE_CHECKING:
    from verl_hpc.runtime.placement.distributed import DistributedPlacement

STOP = "stop"


def _exchange(group: dist.ProcessGroup, payload: Any) -> list[Any]:
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, payload, group=group)
    return parts


def _positions(batch: RolloutBatch, n: int) -> list[int]:
    return [row_position(g, s, n) for g, s in zip(batch.column("group_id").to_pylist(),
                                                  batch.column("sample_index").to_pylist(), strict=True)]


class RoleClient:
    """Trainer side of one remote role."""

    def __init__(self, role: str, group: dist.ProcessGroup, placement: DistributedPlacement):
        self.role, self.group, self.placement = role, group, placement

    def call(self, batch: RolloutBatch) -> list[Any] | None:
        """Per-row results for this rank's rows, in their order."""
        _exchange(self.group, batch.to_ipc())
        answers = _exchange(self.group, None)
        merged: dict[int, Any] = {}
        for part in answers:
            if part:
                merged.update(part)
        n = self.placement.cfg.algorithm.sampling.n
        return [merged[pos] for pos in _positions(batch, n)]

    def call_tokens(self, batch: RolloutBatch, like: torch.Tensor) -> torch.Tensor:
        """A per-token result ([B, R], zero past each response) for this rank's rows."""
        rows = self.call(batch) or []
        out = torch.zeros_like(like, dtype=torch.float32)
        for i, values in enumerate(rows):
            out[i, :len(values)] = torch.from_numpy(np.asarray(values, dtype=np.float32))
        return out

    def stop(self) -> None:
        try:
            _exchange(self.group, STOP)
        except RuntimeError as err:  # best effort: a dead serving rank must not hide the stop's cause
            from verl_hpc.utils.logging import get_logger

            get_logger("placement").warning("the %s group did not take the stop message: %s", self.role, err)


class RoleService:
    """The serving side: the reference model's logprobs or the reward's scores, step after step."""

    def __init__(self, role: str, group: dist.ProcessGroup, placement: DistributedPlacement):
        self.role, self.group, self.placement = role, group, placement

    def serve_step(self, step: int) -> bool:
        p = self.placement
        p.heartbeat.enter(f"step {step} {self.role}")
        parts = _exchange(self.group, None)
        if any(part == STOP for part in parts):
            return False
        batches = [RolloutBatch.from_ipc(part) for part in parts if part]
        full = RolloutBatch.concat(batches).sorted_by_row()
        start, end = even_slices(len(full), dist.get_world_size(self.group) - p.world, p.ctx.rank_in_group)
        mine = full.take(list(range(start, end)))
        results = self.compute(mine) if len(mine) else []
        positions = _positions(mine, p.cfg.algorithm.sampling.n)
        _exchange(self.group, dict(zip(positions, results, strict=True)))
        return True

    def compute(self, batch: RolloutBatch) -> list[Any]:
        p = self.placement
        roles = p.roles
        if self.role == "reward":
            return roles.reward.score(batch).tolist()  # type: ignore[union-attr]
        inputs = to_device(batch.model_inputs(roles.pad_id), roles.device)
        micro = p.cfg.algorithm.micro_batch_size or len(batch)
        logprobs = batched_logprobs(roles.ref_model, inputs, p.cfg.algorithm.sampling.temperature, micro)
        lengths = batch.response_lengths()
        values = logprobs.float().cpu().numpy()
        return [values[i, :lengths[i]].tolist() for i in range(len(batch))]
