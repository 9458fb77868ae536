"""A reward with DAPO's overlong penalty added (config: `reward.overlong_buffer`).

Why a wrapper around whichever reward the run scores with (rule function, verl
`compute_score`, reward model): the penalty depends only on each response's length, so it
applies wherever the rows are scored (beside the trainer, beside the rollout, in a reward
group) and every placement adds the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_hpc.algo.overlong import overlong_penalty
from verl_hpc.data.rollout_batch import RolloutBatch


class OverlongShapedReward:
    def __init__(self, inner: Any, max_new_tokens: int, buffer_len: int, penalty_factor: float):
        self.inner = inner
        self.max_new_tokens, self.buffer_len, self.penalty_factor = max_new_tokens, buffer_len, penalty_factor
        self.last: dict[str, float] = {}

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        base = self.inner.score(batch)
        lengths = torch.as_tensor(batch.model_token_counts())  # the model's tokens: tool replies do not count
        penalty = overlong_penalty(lengths, self.max_new_tokens, self.buffer_len, self.penalty_factor)
        if len(batch):
            self.last = {"reward/overlong_penalty/mean": float(penalty.mean()),
                         "reward/overlong/ratio": float((penalty < 0).float().mean())}
        return base.to(torch.float32) + penalty.to(base.device)

    def metrics(self) -> dict[str, float]:
        return {**self.inner.metrics(), **self.last}

    def describe(self) -> str:
        return (f"{self.inner.describe()} + overlong penalty (last {self.buffer_len} of "
                f"{self.max_new_tokens} tokens, factor {self.penalty_factor:g})")

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:  # anything else the run asks of a reward
        return getattr(self.inner, name)
