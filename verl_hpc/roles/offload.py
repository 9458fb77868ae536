"""Parameter offload for the roles that need their weights only for a pass: the reference and the critic.

Why: a reference policy runs one forward per step and a critic one forward and one update;
between those passes their weights sit idle in accelerator memory that the actor's
activations and the rollout's KV cache could use (verl's `param_offload`). A sharded role
gets FSDP2's `CPUOffloadPolicy` (see `shard_model`): its shards live in pinned host memory
and each layer's is copied in for its all-gather. An unsharded role is moved whole by
`ParamOffload`: onto the device for a pass, back to pinned host memory after it. A frozen
model (the reference) never changes, so its host copy is kept and going back costs nothing;
a trained one (the critic) copies its new weights back and drops its gradients, which the
next update's `zero_grad(set_to_none=True)` would drop anyway.

On a CPU there is nowhere to offload to, and both are no-ops, so one config moves from a
laptop to a cluster unchanged and trains to the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from verl_hpc.utils.logging import get_logger

log = get_logger("offload")


def offloads_to_host(enabled: bool, device: torch.device) -> bool:
    """Whether offload does anything: asked for, and the role computes on an accelerator."""
    return enabled and device.type != "cpu"


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


class ParamOffload:
    """Keeps an unsharded module's tensors in host memory except inside `resident()`."""

    def __init__(self, module: nn.Module, device: torch.device, enabled: bool, name: str = "model",
                 on_cpu: bool = False) -> None:
        """`on_cpu`: do the moves even when `device` is the CPU (tests of the bookkeeping)."""
        self.module, self.device = module, device
        self.active = (offloads_to_host(enabled, device) or (enabled and on_cpu)) and not is_sharded(module)
        self.trained = any(p.requires_grad for p in module.parameters())
        self.host: dict[str, torch.Tensor] = {}  # parameter or buffer name -> its pinned host copy
        self.passes = 0
        if self.active:
            self._to_host(copy=True)
            log.info("%s: %.1f MB of parameters offloaded to host memory between passes (model.param_offload)",
                     name, sum(t.numel() * t.element_size() for t in self.host.values()) / 1e6)

    @classmethod
    def none(cls) -> ParamOffload:
        """No offload (a role this process does not host)."""
        return cls(nn.Module(), torch.device("cpu"), False)

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """By name, so a checkpoint load that assigns new parameter objects still finds their copies."""
        yield from self.module.named_parameters()
        yield from self.module.named_buffers()

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The module's tensors on its device for the body; back in host memory after, even on error."""
        if not self.active:
            yield
            return
        for name, tensor in self._tensors():
            tensor.data = self.host[name].to(self.device, non_blocking=True, copy=True)
        try:
            yield
        finally:
            self._to_host(copy=self.trained)
            self.passes += 1

    @torch.no_grad()
    def _to_host(self, copy: bool) -> None:
        """Each tensor's storage back into its pinned host copy (copying it first when it may have changed)."""
        for name, tensor in self._tensors():
            host = self.host.get(name)
            fresh = host is None
            if host is None:
                host = self.host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                                          pin_memory=torch.cuda.is_available())
            if fresh or copy:
                host.copy_(tensor.data)
            tensor.data = host
            if isinstance(tensor, nn.Parameter):
                tensor.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies finish before the device storage is reused
