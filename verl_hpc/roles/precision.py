"""Which dtype a role's forward and backward compute in, and how that is applied.

Why a resolver: `model.mixed_precision: auto` (the default) means bf16 compute where the
device does it natively (a CUDA GPU with bf16, Ampere and newer) and fp32 everywhere else,
so one config is right on a laptop CPU and on an H100 alike; CPU numbers stay exactly the
fp32 ones. Master weights, gradient reduction and optimizer state stay fp32 in every case:
an FSDP2-sharded model gets a `MixedPrecisionPolicy` (`roles.fsdp.shard_model`), and a
model that is not sharded (a lone trainer) runs its forward under `torch.autocast`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.roles.fsdp import shard_model

log = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bfloat16": torch.bfloat16,
                                                  "float16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware (a CUDA GPU of compute capability 8.0+)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def compute_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """`model.mixed_precision` on `device`: the compute dtype, or None for fp32 throughout."""
    if setting == "auto":
        return torch.bfloat16 if native_bf16(device) else None
    return COMPUTE_DTYPES[setting]


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Run `model`'s forward under autocast to `dtype` (parameters stay fp32); returns `model`.

    Hooks, not a wrapper module, so the state dict's keys (checkpoints, exports) and
    `copy.deepcopy` behave as for the bare model; the exit hook runs even when the forward
    raises, so a failed forward never leaves autocast on.
    """
    if dtype is None:
        return model
    device_type = next(model.parameters()).device.type
    active: list[Any] = []

    def enter(_module: torch.nn.Module, _args: Any) -> None:
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        active.append(context)

    def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return model


def shard_or_autocast(model: torch.nn.Module, setting: str, device: torch.device,
                      group: dist.ProcessGroup | None, offload: bool = False) -> torch.nn.Module:
    """`model` computing in `model.mixed_precision`'s dtype on `device`; returns it.

    Over a role's group: FSDP2-sharded with that dtype as its param dtype. On a lone rank
    (no group): unsharded, its forward under autocast. Every model a role trains or runs
    (actor, ref, critic; DPO's policy and ref) goes through here, so they agree. `offload`:
    a sharded model's shards in host memory (an unsharded one is moved by `ParamOffload`).
    """
    dtype, name = compute_dtype(setting, device), type(model).__name__  # FSDP2 renames the class
    if group is not None:
        shard_model(model, group, device.type, dtype, offload)
    else:
        autocast_forward(model, dtype)
    how = "FSDP2" if group is not None else "autocast" if dtype is not None else "unsharded"
    log.info("%s computes in %s (model.mixed_precision: %s, %s)", name, dtype or torch.float32,
             setting, how)
    return model
