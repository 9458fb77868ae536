"""What the actor and the critic share: AdamW with a per-step LR schedule, the clipped step, the state.

Why one place: a trained role's checkpointed state is exactly model + optimizer + LR
schedule (a LoRA actor's frozen base weights excluded: they come from the model directory),
and its step must treat a non-finite gradient the same way for both (skip
the step rather than poison the weights); two copies had already drifted apart (the
critic stepped on non-finite gradients).
"""

from __future__ import annotations

import math

import torch

from verl_hpc.config.schema import OptimConfig
from verl_hpc.roles.lora import load_trainable_state, trainable_state
from verl_hpc.utils.dtensor import to_float


def build_optimizer(params, cfg: OptimConfig, total_steps: int):
    """AdamW and a per-step LR schedule (linear warm-up, then constant or cosine)."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            span = max(1, total_steps - cfg.warmup_steps)
            progress = min(1.0, (step - cfg.warmup_steps) / span)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class OptimizedModel:
    """A model trained by its own AdamW; subclasses add the loss."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, total_steps: int) -> None:
        self.model = model
        self.optim_cfg = optim
        # Only what trains: a LoRA actor's frozen base gets no optimizer state.
        trainable = [param for param in model.parameters() if param.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(trainable, optim, total_steps)

    def clip_and_step(self) -> float:
        """Clip the gradient norm and step; a non-finite norm skips the step. Returns the norm.

        The gradients are freed either way: they live only inside an optimizer step, so the next
        step's generation and log-prob passes do not carry a model-sized copy nobody reads.
        """
        max_norm = self.optim_cfg.grad_clip or float("inf")
        grad_norm = to_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if math.isfinite(grad_norm):  # a non-finite gradient would poison the weights: skip the step
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def state_dict(self) -> dict:
        return {"model": trainable_state(self.model), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_trainable_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
