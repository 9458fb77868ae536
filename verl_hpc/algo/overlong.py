"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4).

Why shaped rather than truncated-and-zeroed: a response cut at `max_new_tokens` says
nothing about its answer, and scoring it as wrong teaches the model that length is bad
only at the cliff. The penalty instead grows linearly over the last `buffer_len` tokens
before the limit, from 0 to `-penalty_factor`, so the policy feels the limit coming.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """Per response: min(0, -(length - (max_new_tokens - buffer_len)) / buffer_len * penalty_factor)."""
    if buffer_len <= 0:
        raise ValueError("buffer_len must be positive")
    expected = max_new_tokens - buffer_len
    exceed = lengths.to(torch.float64) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0).to(torch.float32)
