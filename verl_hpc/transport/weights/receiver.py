"""The rollout ranks' end of a weight sync: the header, then every bucket as it lands.

Why one receiver for every sender: the header says who sends the buckets (the leader, or
every trainer rank at once), and this rank's links say where they come from (the sync
group, or the previous hop of the chain), so the same `receive` serves every backend.

Why `arrived`: a rollout rank between two generation rounds (partial rollouts) takes new
weights only if the trainer has sent them, without waiting. It posts the receive of the
next sync's header (the first collective of every sync, a stop included) and asks whether
it completed; the header then stays posted until `receive` takes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.transport.weights.base import SyncLinks, WeightReceiver
from verl_hpc.transport.weights.bucketed import DEFAULT_BUCKET_BYTES, receive_weights
from verl_hpc.transport.weights.shard import ShardReceiver


class BucketReceiver(WeightReceiver):
    def __init__(self, links: SyncLinks, device: torch.device | str = "cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.links, self.device, self.bucket_bytes = links, device, bucket_bytes
        self.shards: ShardReceiver | None = None  # the first rollout rank's, made at its first sync
        self.posted: tuple[torch.Tensor, Any] | None = None  # the next header's receive, once `arrived` posted it

    def arrived(self) -> bool:
        """Whether the next sync's header is in; never blocks (posts its receive the first time)."""
        if self.posted is None:
            header = torch.empty(4, dtype=torch.int64, device=self.device)
            self.posted = header, dist.broadcast(header, src=self.links.src, group=self.links.group, async_op=True)
        return bool(self.posted[1].is_completed())

    def receive(self, specs: list[tuple[str, torch.Size]], into: torch.Tensor | None = None,
                ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        if self.shards is None and self.links.shard_links is not None:
            self.shards = ShardReceiver([shape for _, shape in specs], self.links.shard_links)
        header = None
        if self.posted is not None:
            (header, work), self.posted = self.posted, None
            work.wait()
        return receive_weights(specs, self.links.group, self.links.src, self.bucket_bytes,  # type: ignore[arg-type]
                               device=self.device, into=into, relay=self.links.relay, shards=self.shards,
                               header=header)
