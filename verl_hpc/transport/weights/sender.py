"""The trainer ranks' ends of a split run's weight syncs (base.py): broadcast, own rows, or a join.

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
from torch import nn

from verl_hpc.transport.weights.base import SyncLinks, WeightSender
from verl_hpc.transport.weights.bucketed import (
    DEFAULT_BUCKET_BYTES,
    join_send_gathers,
    post_weights,
    send_header,
    send_plan,
)
from verl_hpc.transport.weights.flat import flatten_params
from verl_hpc.transport.weights.shard import send_shards, shard_sendable
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


class BroadcastSender(WeightSender):
    """The leader sends `model`'s weights each sync over the sync group (down the chain when there
    is one); with a flat actor, leaves each sync in flight until `optimizer`'s next step (or the
    next sync, or `settle`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, links: SyncLinks,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.model, self.links, self.bucket_bytes = model, links, bucket_bytes
        self.in_flight = SyncInFlight()
        self.overlaps = optimizer is not None and flatten_sender(model)
        if self.overlaps:
            optimizer.register_step_pre_hook(lambda *_: self.in_flight.wait())  # type: ignore[union-attr]

    def send(self, version: int) -> int:
        """Post version `version` (the previous sync finished first); returns the bytes it moves."""
        self.in_flight.wait()
        _, sent, self.in_flight = post_weights(self.model, self.links.group, self.links.src, version,  # type: ignore[arg-type]
                                               self.bucket_bytes, self.links.relay)
        return sent

    def settle(self, timeout: timedelta | None = None) -> None:
        self.in_flight.wait(timeout)


class ShardSender(WeightSender):
    """Every trainer rank of an FSDP2 actor in host memory sends its own rows (the leader first
    sends the header), straight to the first rollout rank over its pair group: no gather."""

    def __init__(self, model: nn.Module, links: SyncLinks, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.model, self.links, self.bucket_bytes = model, links, bucket_bytes

    def send(self, version: int) -> int:
        if self.links.group is not None:
            send_header(self.model, self.links.group, self.links.src, version)
        return send_shards(self.model, send_plan(self.model, self.bucket_bytes), self.links.shard_link)


class GatherJoin(WeightSender):
    """A trainer rank outside the sync group: it joins the gathers the leader's send needs, sends nothing."""

    def __init__(self, model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.model, self.bucket_bytes = model, bucket_bytes

    def send(self, version: int) -> int:
        join_send_gathers(self.model, self.bucket_bytes)
        return 0


def weight_sender(model: nn.Module, optimizer: torch.optim.Optimizer | None, links: SyncLinks) -> WeightSender:
    """Which end this trainer rank is (base.py): its own rows, the leader's broadcast, or a gather's join."""
    if links.shard_link is not None and shard_sendable(model):
        return ShardSender(model, links)
    if links.group is None:
        return GatherJoin(model)
    return BroadcastSender(model, optimizer, links)
