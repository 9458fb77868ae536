"""The weight sync's chain: trainer rank 0 -> rollout rank 0 -> rollout rank 1 -> ...

Why a chain: one broadcast from trainer rank 0 to R rollout ranks is a binomial tree in
gloo, so rank 0 sends every byte ceil(log2(R + 1)) times (1, 2, 3, 3, 3 for R = 1...5), and
the sync slows as replicas are added — the sender's NIC carries the model that many times.
In a chain every rank sends each byte at most once and rank 0 exactly once, whatever R.
Buckets are pipelined: a rollout rank forwards bucket k while it receives bucket k + 1,
so the sync takes about (model + (R - 1) * bucket) / bandwidth instead of log2(R + 1) * model
/ bandwidth (NeMo-RL and OpenRLHF chain or shard their refits for the same reason).

Each link is a two-rank process group (runtime/process/dist.py makes them, collectively, at the
start); a broadcast inside a pair is one send. The header (version, sizes, or STOP) still
goes to every receiver at once over the whole sync group: it is tiny, and STOP must reach
the last rank even if no data follows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FORWARDS_IN_FLIGHT = 2  # buckets a rank may still be sending downstream while it receives the next


@dataclass(frozen=True)
class Relay:
    """This rank's links in the chain (global ranks; None at either end)."""

    rank: int
    up: dist.ProcessGroup | None = None
    up_rank: int | None = None
    down: dist.ProcessGroup | None = None


def chain_links(leader: int, rollout_ranks: list[int]) -> list[list[int]]:
    """The chain's pairs, in order: [[leader, r0], [r0, r1], ...]; none for a single receiver
    (there the whole sync group already is the pair)."""
    chain = [leader, *rollout_ranks]
    return [chain[i:i + 2] for i in range(len(chain) - 1)] if len(rollout_ranks) > 1 else []


def relay_for(rank: int, links: list[list[int]], groups: list[Any]) -> Relay | None:
    """`rank`'s place in the chain made of `links` (their process groups in `groups`)."""
    ups = [i for i, pair in enumerate(links) if pair[1] == rank]
    downs = [i for i, pair in enumerate(links) if pair[0] == rank]
    if not ups and not downs:
        return None
    up = ups[0] if ups else None
    down = downs[0] if downs else None
    return Relay(rank=rank, up=groups[up] if up is not None else None,
                 up_rank=links[up][0] if up is not None else None,
                 down=groups[down] if down is not None else None)


class Forwarder:
    """A receiving link's sends downstream: each bucket as soon as it has landed, at most
    `FORWARDS_IN_FLIGHT` at once (a bucket's memory is held until its send is done)."""

    def __init__(self, relay: Relay | None):
        self.relay = relay if relay is not None and relay.down is not None else None
        self.works: deque[tuple[Any, torch.Tensor]] = deque()
        self.last_done: torch.Tensor | None = None  # kept past its wait: see utils/collective.py

    def forward(self, flat: torch.Tensor) -> None:
        if self.relay is None:
            return
        while len(self.works) >= FORWARDS_IN_FLIGHT:
            self._finish_oldest()
        self.works.append((dist.broadcast(flat, src=self.relay.rank, group=self.relay.down, async_op=True), flat))

    def finish(self) -> None:
        while self.works:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, self.last_done = self.works.popleft()
        work.wait()
