"""Moving the actor's new weights into the rollout engine after every update.

Colocated (hybrid engine): the trainer ranks themselves host the engine; parameters are
gathered one at a time from the FSDP2 shards and copied straight into the engine's
tensors, so no rank ever holds a second full copy of the model — at most one extra
parameter. Split: trainer rank 0 broadcasts the gathered parameters over the sync group
to the rollout ranks. Both sides walk `named_parameters()` of the same architecture in
the same order and cut it into the same buckets (`_buckets`, a pure function of the
sizes), so only a small header (version, count, elements) crosses the wire besides data.

No copy that can be avoided is made (bench/weight_sync.py: on this box a fresh 78 MB
bucket cost more in page faults than the broadcast itself, and every copy competes with
the transfer for the same memory bandwidth). A parameter of half a bucket or more
travels alone, as the sender's own (or freshly gathered) tensor, and so does a run of
parameters already back to back in one storage; the rest is packed into two bucket
buffers reused across syncs. Every transfer is a broadcast (down the chain of
`weight_relay.py` with several receivers; inside two-rank groups for a sharded actor's
ranks that send their own rows, `shard_sync.py`). A receiver whose
weights are views into one flat buffer
(`flat_weights.flatten_params`: the HF engine's own copy) has every bucket land
straight in its slice, nothing left to unpack. A sender laid out the same way (a split
run's lone actor, `weight_sender.flatten_sender`) sends views and may leave the sync in flight
(`post_weights`): the transfer overlaps the next step until its optimizer step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_hpc.transport.weights.chain import Forwarder, Relay
from verl_hpc.transport.weights.flat import WIRE_DTYPE, flat_view, flatten_params, params_view, same_memory
from verl_hpc.transport.weights.gather import bucket_gatherer
from verl_hpc.transport.weights.shard import ShardReceiver
from verl_hpc.transport.weights.views import merged_params, merged_shapes
from verl_hpc.transport.weights.window import SyncInFlight, Window, transfer
from verl_hpc.utils.collective import broadcast_kept

# At most this many bytes of packed or gathered tensors are on the wire at once (two
# buckets: the sender prepares one while the other crosses), so an FSDP sender never
# holds more than that beyond its shards; large enough for NCCL's bandwidth.
DEFAULT_BUCKET_BYTES = 16 * 2**20
STOP_VERSION = -2  # a header with this version tells the receivers to stop: no weights follow
FROM_LEADER, FROM_EVERY_RANK = 0, 1  # a header's last field: who sends the buckets (shard_sync.py)
# Per sending model: the two packing buffers, reused every sync; they go away with the model.
_PACK_BUFFERS: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = weakref.WeakKeyDictionary()


class WeightSyncError(RuntimeError):
    """The two sides of a sync disagree (architecture, version): never load half a model."""


def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter; on FSDP2 every rank of the mesh must iterate.

    A LoRA actor yields the plain architecture's weights, adapters merged in
    (`lora.merged_params`): that is what the engines hold.
    """
    yield from merged_params(model)


def stream_into(source: nn.Module, target: nn.Module) -> int:
    """Colocated sync: copy each gathered parameter of `source` into `target`; returns bytes."""
    target_params = dict(target.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, tensor in iter_full_params(source):
            dest = target_params[name]
            dest.copy_(tensor.to(dest.device, dest.dtype))
            copied += dest.numel() * dest.element_size()
    return copied


def gather_only(model: nn.Module) -> None:
    """Trainer ranks outside the sync group: join each parameter's gather, send nothing.

    Dropping each gathered tensor at once is safe: a host-memory gather's buffers are kept
    by `dtensor._gather_rows` until the next gather has completed (the gloo race behind CI's
    "malloc(): unaligned tcache chunk detected" in this loop, pytorch/pytorch#75529).
    """
    for _ in iter_full_params(model):
        pass


def send_plan(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """The indices of the (merged) parameters in each transfer of a sync: a pure function of
    the shapes, so every trainer rank and every receiver cut the model the same way."""
    return _buckets([(n, s.numel() * WIRE_DTYPE.itemsize) for n, s in merged_shapes(model)], bucket_bytes)


def join_send_gathers(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Trainer ranks outside the sync group: join the gathers of the leader's `post_weights`,
    bucket by bucket when it gathers that way (`bucket_gather.py`), else parameter by parameter."""
    gatherer = bucket_gatherer(model)
    if gatherer is None:
        gather_only(model)
        return
    for k, bucket in enumerate(send_plan(model, bucket_bytes)):
        gatherer.gather(bucket, k % 2)


def _buckets(names_sizes: list[tuple[str, int]], bucket_bytes: int, alone_bytes: int | None = None,
             ) -> list[list[int]]:
    """Indices of consecutive parameters per transfer, each bucket under the limit.

    A parameter of `alone_bytes` (default: half the limit) or more travels alone, so a
    sender can send its own (or its freshly gathered) tensor without a packing copy; on
    gloo here one more broadcast costs ~0.4 ms, the copy of a few MB less, so only big
    ones are worth it there.
    """
    alone_bytes = bucket_bytes // 2 if alone_bytes is None else alone_bytes
    buckets: list[list[int]] = []
    used = 0
    for i, (_, nbytes) in enumerate(names_sizes):
        alone = nbytes >= alone_bytes
        if not buckets or alone or used >= alone_bytes or used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += nbytes
    return buckets


def broadcast_weights(model: nn.Module, group: dist.ProcessGroup, src: int, version: int,
                      is_sender: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      relay: Relay | None = None) -> tuple[int, int]:
    """Bucketed broadcast from `src` (global rank) to every rank of `group`; returns (version, bytes).

    With a `relay` (several receivers) the header goes to the group and the buckets down the
    chain (weight_relay.py): the sender sends each byte once, whatever the number of receivers.

    The sender passes its (possibly FSDP-sharded) actor; receivers pass a model of the
    same architecture and get its parameters overwritten in place (re-homed once into
    one flat buffer when they are all float32, so later syncs land in place). The other
    trainer ranks call `join_send_gathers` at the same time, since the FSDP2 gathers are collectives.
    """
    if is_sender:
        version, sent, in_flight = post_weights(model, group, src, version, bucket_bytes, relay)
        in_flight.wait()
        return version, sent
    params = list(model.named_parameters())
    got, tensors = receive_weights([(n, p.shape) for n, p in params], group, src, bucket_bytes,
                                   params[0][1].device, into=flatten_params(model), relay=relay)
    return got, _copy_into(params, tensors)


def post_weights(model: nn.Module, group: dist.ProcessGroup, src: int, version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, relay: Relay | None = None,
                 ) -> tuple[int, int, SyncInFlight]:
    """The sender's side of `broadcast_weights`, left in flight when it can be: (version, bytes, in flight).

    A flat sender's buckets are views of its parameters: all are posted at once and the
    call returns. Any other sender (FSDP2 gathers, LoRA merges, packing) bounds what it
    holds to two buckets and has finished when it returns.
    """
    device = next(model.parameters()).device  # NCCL moves only GPU tensors; gloo takes either
    views = params_view(model) is not None  # flatten_sender's layout: every bucket a view of the live weights
    window = Window(group, src, limit=math.inf if views else 2 * bucket_bytes,
                     data_group=relay.down if relay is not None else None)
    # Not waited for: the first bucket is prepared while the header crosses (one group: in order).
    window.post(_header(model, version, device), header=True)
    if version == STOP_VERSION:
        window.drain()
        return STOP_VERSION, 0, SyncInFlight()
    sent, packed = 0, 0
    readers: list[Any] = [None, None]  # the broadcast that last read each packing buffer
    holders: list[Any] = [None, None]  # ... and each gather slot (bucket_gather.py)
    gatherer = bucket_gatherer(model)
    gathered = iter_full_params(model) if gatherer is None else None
    for k, bucket in enumerate(send_plan(model, bucket_bytes)):
        if gatherer is not None:
            if holders[k % 2] is not None:
                holders[k % 2].wait()  # bucket k - 2's transfer still reads the slot
            tensors = gatherer.gather(bucket, k % 2)
        else:
            tensors = [next(gathered)[1] for _ in bucket]  # type: ignore[call-overload]
        flat = flat_view(tensors)  # a lone float32 tensor, or a run already back to back: as it is
        if flat is None and sum(t.numel() for t in tensors) * WIRE_DTYPE.itemsize > bucket_bytes:
            # One parameter larger than a bucket that still needs a cast: a transient copy,
            # not a kept buffer that large (a bf16 actor's embedding would pin GBs).
            flat = tensors[0].detach().to(WIRE_DTYPE, memory_format=torch.contiguous_format).reshape(-1)
            work = window.post(flat)
        elif flat is None:
            slot = packed % 2
            if readers[slot] is not None:
                readers[slot].wait()
            flat = _pack(tensors, _pack_buffers(model, bucket_bytes, tensors[0].device)[slot])
            packed += 1
            readers[slot] = work = window.post(flat)
        else:
            work = window.post(flat)
        holders[k % 2] = work
        sent += flat.numel() * flat.element_size()
    if not views:
        window.drain()
    return version, sent, SyncInFlight(window if views else None)


def _header(model: nn.Module | None, version: int, device: torch.device, senders: int = FROM_LEADER,
            ) -> torch.Tensor:
    """What a sync's receivers check before any data: (version, tensors, elements, senders)."""
    shapes = merged_shapes(model) if model is not None else []
    return torch.tensor([version, len(shapes), sum(s.numel() for _, s in shapes), senders], dtype=torch.int64,
                        device=device)


def stop_header(device: torch.device) -> torch.Tensor:
    """The header that ends the rollout ranks' receive loop: sent alone, no buckets follow."""
    return _header(None, STOP_VERSION, device)


def send_header(model: nn.Module, group: dist.ProcessGroup, src: int, version: int) -> None:
    """The leader's header alone: the buckets follow from every trainer rank (`shard_sync.send_shards`)."""
    broadcast_kept(_header(model, version, next(model.parameters()).device, FROM_EVERY_RANK), src, group)


def _pack_buffers(model: nn.Module, bucket_bytes: int, device: torch.device) -> list[torch.Tensor]:
    """The model's two reusable packing buffers, (re)made when too small or on another device."""
    numel = bucket_bytes // WIRE_DTYPE.itemsize
    buffers = _PACK_BUFFERS.get(model)
    if buffers is None or buffers[0].numel() < numel or buffers[0].device != device:
        buffers = [torch.empty(numel, dtype=WIRE_DTYPE, device=device) for _ in range(2)]
        _PACK_BUFFERS[model] = buffers
    return buffers


def _pack(tensors: list[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Copy (and cast) the tensors back to back into the front of `buffer`; returns that slice."""
    offset = sum(t.numel() for t in tensors)
    if all(t.dtype == buffer.dtype for t in tensors):  # one op: many small copies cost more in calls
        return torch.cat([t.reshape(-1) for t in tensors], out=buffer[:offset])
    offset = 0
    for tensor in tensors:
        buffer[offset:offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        offset += tensor.numel()
    return buffer[:offset]


def _check_header(header: torch.Tensor, specs: list[tuple[str, torch.Size]], rows_reachable: bool) -> int:
    """The elements `specs` hold, once the header agrees with them and with this rank's links."""
    elements = sum(shape.numel() for _, shape in specs)
    if int(header[1]) != len(specs) or int(header[2]) != elements:
        raise WeightSyncError(f"actor and rollout models differ: sender has {int(header[1])} tensors / "
                              f"{int(header[2])} elements, receiver {len(specs)} / {elements}")
    if int(header[3]) == FROM_EVERY_RANK and not rows_reachable:
        raise WeightSyncError("the trainer ranks send their own rows, but this rank has no link to them")
    return elements


def receive_weights(specs: list[tuple[str, torch.Size]], group: dist.ProcessGroup, src: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | str = "cpu",
                    into: torch.Tensor | None = None, relay: Relay | None = None,
                    shards: ShardReceiver | None = None, header: torch.Tensor | None = None,
                    ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """Receiver side of `broadcast_weights`: the version, then (name, tensor) as buckets land.

    The iterator must be consumed to the end (each bucket is a collective); an engine's
    `load_weights` does exactly that. A STOP header yields no tensors. `into`: a flat
    float32 buffer holding the engine's weights in `specs` order (`engine_buffer`):
    every bucket is received straight into it at once and the yielded tensors are views
    of it, already in place. Without it (or if it does not fit) each bucket gets fresh
    memory, one bucket ahead, which the consumer may keep (vLLM's loader holds them all).
    `relay`: buckets come from the previous link of the chain and go on to the next.
    `shards`: buckets come from every trainer rank at once, each its rows (`shard_sync.py`).
    `header`: the sync's header if already received (a rank that polled for it: `BucketReceiver.arrived`).
    """
    if header is None:
        header = broadcast_kept(torch.empty(4, dtype=torch.int64, device=device), src, group)
    version = int(header[0])
    if version == STOP_VERSION:
        return STOP_VERSION, iter(())
    elements = _check_header(header, specs, shards is not None or (relay is not None and relay.up_rank != src))
    shards = shards if int(header[3]) == FROM_EVERY_RANK else None
    data_group, data_src = (relay.up, relay.up_rank) if relay is not None and relay.up is not None else (group, src)
    buckets = _buckets([(n, shape.numel() * WIRE_DTYPE.itemsize) for n, shape in specs], bucket_bytes)
    if into is not None and not (into.dtype == WIRE_DTYPE and into.is_contiguous() and into.numel() == elements
                                 and into.device.type == torch.device(device).type):
        into = None
    starts = [0]
    for bucket in buckets:
        starts.append(starts[-1] + sum(specs[i][1].numel() for i in bucket))

    def post(k: int) -> tuple[torch.Tensor, Any]:
        flat = into[starts[k]:starts[k + 1]] if into is not None else \
            torch.empty(starts[k + 1] - starts[k], dtype=WIRE_DTYPE, device=device)
        return flat, shards.post(k, buckets[k], flat) if shards is not None else transfer(flat, data_src, data_group)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        # In place, every bucket is posted at once; otherwise bucket k+1 is received while
        # the consumer copies bucket k's tensors.
        posted = [post(k) for k in range(len(buckets))] if into is not None else [post(0)] if buckets else []
        onward = Forwarder(relay)
        for k, bucket in enumerate(buckets):
            flat, work = posted[k]
            work.wait()
            onward.forward(flat)
            if k + 1 == len(posted) < len(buckets):
                posted.append(post(k + 1))
            offset = 0
            for i in bucket:
                name, shape = specs[i]
                yield name, flat[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
        onward.finish()

    return version, tensors()


def push_weights(named_tensors: Iterator[tuple[str, torch.Tensor]], engine, version: int) -> int:
    """Feed (name, tensor) pairs into a rollout engine's `load_weights`; returns the bytes moved."""
    moved = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal moved
        for name, tensor in named_tensors:
            moved += tensor.numel() * tensor.element_size()
            yield name, tensor

    engine.load_weights(counted(), version)
    return moved


@torch.no_grad()
def _copy_into(params: list[tuple[str, nn.Parameter]], tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    moved = 0
    for (_, param), (_, tensor) in zip(params, tensors, strict=True):
        if not same_memory(param, tensor):  # received in place: nothing left to copy
            param.copy_(tensor.to(param.device, param.dtype))
        moved += tensor.numel() * tensor.element_size()
    return moved


def engine_buffer(engine: Any) -> torch.Tensor | None:
    """The engine's weights as one flat buffer to receive into, if it keeps them that way (HF)."""
    buffer = getattr(engine, "weight_buffer", None)
    return buffer() if callable(buffer) else None
