"""A test-only advantage estimator, registered from outside the package (`plugins:` in a config)."""

from __future__ import annotations

import torch

from verl_hpc.algo import AdvantageInputs, register_estimator


@register_estimator("test_constant")
def constant(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every response token gets advantage 1 (and return 1): easy to recognise in the metrics."""
    ones = inputs.response_mask.float()
    return ones, ones.clone()
