"""The two ends of a weight sync, as every backend implements them, and the links between them.

Why a base: a split run's trainer ranks send the actor's new weights after every update and
its rollout ranks load them; which way the bytes travel depends on the actor and the
groups (`links`), not on the step. The placement asks `weight_sender` once which backend a
trainer rank uses and calls `send` every sync:

- `BroadcastSender` (the leader; sender.py): the whole model, bucket by bucket, over the
  sync group — down the chain when the rollout group has several ranks (chain.py); a flat
  lone actor sends views and leaves the sync in flight until its next optimizer step.
- `ShardSender` (every rank of an FSDP2 actor in host memory): each sends its own rows,
  no gather (shard.py).
- `GatherJoin` (the other ranks of any other sharded actor): joins the leader's gathers.

Every receiver is a `BucketReceiver` (receiver.py): a header, then the buckets as they
land, from the leader, the previous link of the chain, or every trainer rank at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.transport.weights.chain import Relay
from verl_hpc.transport.weights.shard import ShardLinks


@dataclass(frozen=True)
class SyncLinks:
    """The process groups one rank's weight syncs travel over (runtime/process/dist.py makes them)."""

    group: dist.ProcessGroup | None     # the sync group: trainer rank 0 + the rollout ranks (None elsewhere)
    src: int                            # trainer rank 0's global rank: every header comes from it
    relay: Relay | None = None          # this rank's hop of the chain through several rollout ranks
    shard_link: Any = None              # a trainer rank's pair group with the first rollout rank
    shard_links: ShardLinks | None = None  # the first rollout rank's pair groups with every trainer rank


class WeightSender(ABC):
    """A trainer rank's end: every trainer rank calls `send` at every sync, in the same order."""

    overlaps = False  # a sync may still cross while the next step runs

    @abstractmethod
    def send(self, version: int) -> int:
        """Send version `version`; returns the bytes this rank moved."""

    def settle(self, timeout: timedelta | None = None) -> None:  # noqa: B027 - most senders finish in `send`
        """The sync in flight, finished (`timeout`: at shutdown, when the receivers may be gone)."""


class WeightReceiver(ABC):
    """A rollout rank's end."""

    @abstractmethod
    def receive(self, specs: list[tuple[str, torch.Size]], into: torch.Tensor | None = None,
                ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """The next version and its (name, tensor) pairs in `specs` order, as buckets land; the
        iterator must be consumed to the end (each bucket is a collective)."""
