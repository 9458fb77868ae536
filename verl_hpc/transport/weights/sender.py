"""Trainer rank 0's side of a split run's weight syncs: flat when it can be, then overlapped.

Why a sender object: a lone (unsharded, float32, adapter-free) actor can keep its
parameters in one buffer laid out in sync order, so every bucket is a view of the live
weights — nothing is packed (`flatten_sender`) and nothing must stay in memory for the
transfer. The sync can then be left in flight while the trainer goes on with the next
step (ref and old log-probs, forward and backward): a weight sync "overlapped with
the next step": on a cluster the bytes cross the NIC while the GPUs compute. The one
thing that must not happen meanwhile is a change to the weights being read, so the
sender hooks the actor's optimizer: its next `step()` first waits for the sync
(`torch.optim.Optimizer.register_step_pre_hook`). Any other actor (FSDP2 gathers, LoRA
merges) sends as before and has finished when `send` returns.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from verl_hpc.transport.weights.bucketed import DEFAULT_BUCKET_BYTES, post_weights
from verl_hpc.transport.weights.chain import Relay
from verl_hpc.transport.weights.flat import flatten_params
from verl_hpc.transport.weights.views import has_adapters
from verl_hpc.transport.weights.window import SyncInFlight


def flatten_sender(model: nn.Module) -> bool:
    """Lay a lone actor's parameters out in one buffer, in sync order; True if they now are.

    Why: a sender whose parameters lie back to back sends every bucket as a view, with no
    packing copy. On a pair that copy is the whole gap to one plain broadcast: on loopback
    a broadcast is two memory copies, one per process, and packing adds a third that two
    busy cores cannot hide (bench/weight_sync.py: ~1.5x packed, ~1.2x from views). Only a
    split run's unsharded float32 actor qualifies: FSDP2 shards are gathered into fresh
    tensors every sync, and a LoRA actor sends freshly merged weights. The optimizer keeps
    the same `nn.Parameter` objects; checkpoints (DCP clones a view before writing it) and
    the HF export read the views like any tensor.
    """
    if has_adapters(model):
        return False
    return flatten_params(model) is not None


class WeightSender:
    """Sends `model`'s weights each sync; with a flat actor, leaves each sync in flight until
    `optimizer`'s next step (or the next sync, or `settle`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.model, self.bucket_bytes = model, bucket_bytes
        self.in_flight = SyncInFlight()
        self.overlaps = optimizer is not None and flatten_sender(model)
        if self.overlaps:
            optimizer.register_step_pre_hook(lambda *_: self.in_flight.wait())  # type: ignore[union-attr]

    def send(self, group: dist.ProcessGroup, src: int, version: int, relay: Relay | None = None) -> int:
        """Post version `version` (the previous sync finished first); returns the bytes it moves."""
        self.in_flight.wait()
        _, sent, self.in_flight = post_weights(self.model, group, src, version, self.bucket_bytes, relay)
        return sent

    def settle(self, timeout: timedelta | None = None) -> None:
        """The sync in flight, finished (`timeout`: at shutdown, when the receivers may be gone)."""
        self.in_flight.wait(timeout)
