"""GRPO (Shao et al., 2024, arXiv:2402.03300): a response's score against its own prompt group."""

from __future__ import annotations

from torch import Tensor

from verl_hpc.algo.advantages import grpo_advantages
from verl_hpc.algo.registry import AdvantageInputs, register_estimator


@register_estimator("grpo", whole_groups=True, min_group_size=2)
def grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Group-relative: (score - group mean) / group std, no critic."""
    return grpo_advantages(inputs.scores, inputs.group_ids, inputs.response_mask, inputs.algo.norm_adv_by_std)
