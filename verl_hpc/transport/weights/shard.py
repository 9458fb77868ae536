"""A sharded actor's weight sync with no gather: every trainer rank sends its own rows at once.

Why: an FSDP2 actor over W trainer ranks used to gather each bucket onto the leader and then
send it (`bucket_gather.py`): the bytes crossed twice, and the leader carried the whole model
(bench/weight_sync.py, sender `fsdp`: 2.3x one plain broadcast on 16 cores, 3.2-3.8x on two).
Here trainer rank r sends its rows of each bucket straight to the first rollout rank, over a
two-rank group of their own (a broadcast inside a pair is one send: the chain's links do the
same, `weight_relay.py`). The rollout rank takes in W streams at once, each a W-th of the
model; no trainer rank holds or sends more than its shard (NeMo-RL's refit works this way).

Layout: FSDP2 shards dim 0 in ceil(n / W) rows per rank (the last ranks may hold fewer, or
none). A bucket of one parameter: rank r's rows are one run of it, so the shard is sent as it
is and lands in place. A bucket of several: rank r packs its rows of each, back to back, into
one message, and the receiver files each parameter's rows where they belong. Both sides cut
the model into the same buckets (`weight_sync.send_plan`), so only the header crosses besides
data, and it still comes from the leader over the sync group.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_hpc.transport.weights.flat import WIRE_DTYPE
from verl_hpc.transport.weights.gather import bucket_gatherer, rows_of

# Per sending model: one kept buffer for its packed rows (the buckets of several parameters).
_PACKED: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ShardLinks:
    """The first rollout rank's pair group with each trainer rank, in the trainer group's order."""

    groups: list[dist.ProcessGroup]
    ranks: list[int]  # the trainer ranks' global ranks (each pair's source)


def shard_sendable(model: nn.Module) -> bool:
    """Whether `model` can send its rows itself: FSDP2 row shards in host memory, float32, no adapters."""
    gatherer = bucket_gatherer(model)
    return gatherer is not None and gatherer.params[0].dtype == WIRE_DTYPE


def send_shards(model: nn.Module, plan: list[list[int]], link: dist.ProcessGroup) -> int:
    """This trainer rank's rows of every bucket to the first rollout rank; returns bytes sent.

    `plan`: `weight_sync.send_plan(model)`; `link`: this rank's pair group with the first
    rollout rank. Waits until every message has left, since the shards are the live weights.
    """
    gatherer = bucket_gatherer(model)
    assert gatherer is not None, "send_shards needs shard_sendable(model)"
    world, rank, me = gatherer.world, gatherer.me, dist.get_rank()
    locals_ = [p.to_local().reshape(-1) for p in gatherer.params]
    shapes = [p.shape for p in gatherer.params]
    packed = _packed_buffer(model, plan, shapes, world, rank)
    works, sent, offset = [], 0, 0
    for bucket in plan:
        pieces = [locals_[i] for i in bucket]
        for i, piece in zip(bucket, pieces, strict=True):
            expected = rows_of(shapes[i], world, rank)[1]
            if piece.numel() != expected:  # the receiver files rows by this rule: never send another layout
                raise RuntimeError(f"parameter {i}: {piece.numel()} local elements, expected {expected} "
                                   "(not FSDP2's row sharding)")
        numel = sum(p.numel() for p in pieces)
        if numel == 0:
            continue
        if len(pieces) == 1:
            message = pieces[0]
        else:
            message = torch.cat(pieces, out=packed[offset:offset + numel])
            offset += numel
        works.append(dist.broadcast(message, src=me, group=link, async_op=True))
        sent += numel * message.element_size()
    for work in works:
        work.wait()
    return sent


def _packed_buffer(model: nn.Module, plan: list[list[int]], shapes: list[torch.Size], world: int,
                   rank: int) -> torch.Tensor:
    numel = sum(rows_of(shapes[i], world, rank)[1] for bucket in plan if len(bucket) > 1 for i in bucket)
    buffer = _PACKED.get(model)
    if buffer is None or buffer.numel() < numel:
        buffer = _PACKED[model] = torch.empty(max(numel, 1), dtype=WIRE_DTYPE)
    return buffer


class ShardReceiver:
    """The first rollout rank's side: bucket k from every trainer rank, laid out as the full bucket."""

    def __init__(self, shapes: list[torch.Size], links: ShardLinks):
        self.shapes, self.links = shapes, links
        self.world = len(links.ranks)
        self._stages: dict[int, torch.Tensor] = {}  # bucket -> its kept staging buffer (several parameters)

    def post(self, k: int, bucket: list[int], flat: torch.Tensor) -> _Landing:
        """Post bucket k (parameter indices `bucket`) into `flat`, its full layout; `.wait()` fills it."""
        if len(bucket) == 1:
            works = []
            for r in range(self.world):
                start, count = rows_of(self.shapes[bucket[0]], self.world, r)
                if count:
                    works.append(self._recv(flat[start:start + count], r))
            return _Landing(works)
        sizes = [[rows_of(self.shapes[i], self.world, r)[1] for i in bucket] for r in range(self.world)]
        stage = self._stage(k, flat.numel())
        works, at = [], 0
        for r in range(self.world):
            if sum(sizes[r]):
                works.append(self._recv(stage[at:at + sum(sizes[r])], r))
            at += sum(sizes[r])
        return _Landing(works, lambda: self._file(bucket, stage, flat))

    def _recv(self, into: torch.Tensor, r: int) -> Any:
        return dist.broadcast(into, src=self.links.ranks[r], group=self.links.groups[r], async_op=True)

    def _stage(self, k: int, numel: int) -> torch.Tensor:
        if k not in self._stages or self._stages[k].numel() < numel:
            self._stages[k] = torch.empty(numel, dtype=WIRE_DTYPE)
        return self._stages[k]

    def _file(self, bucket: list[int], stage: torch.Tensor, flat: torch.Tensor) -> None:
        """Rank-major rows (as sent) -> each parameter's rows in order (as the bucket holds them)."""
        at, base = 0, 0
        starts = []
        for i in bucket:
            starts.append(base)
            base += math.prod(self.shapes[i])
        for r in range(self.world):
            for j, i in enumerate(bucket):
                first, count = rows_of(self.shapes[i], self.world, r)
                flat[starts[j] + first:starts[j] + first + count].copy_(stage[at:at + count])
                at += count


class _Landing:
    """A bucket's receives in flight; `wait()` once they have all landed and been filed."""

    def __init__(self, works: list[Any], then: Any = None):
        self.works, self.then = works, then

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
            self.then = None
