"""Gradients as an optimizer step begins: a role frees them right after its step, so tests that
compare gradients take them here (`OptimizedModel.clip_and_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def gradients_at_the_step(role: Any, convert: Callable[[torch.Tensor], torch.Tensor] = torch.clone
                          ) -> dict[str, torch.Tensor]:
    """Filled with `role.model`'s gradients (through `convert`) when `role.optimizer` next steps."""
    grads: dict[str, torch.Tensor] = {}
    role.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: convert(p.grad) for n, p in role.model.named_parameters() if p.grad is not None}))
    return grads
