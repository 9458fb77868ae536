"""The project's bucketed weight broadcast vs one plain broadcast of the same bytes.

Two processes on gloo (NCCL on a GPU machine would run the same code): rank 0 holds the
actor, rank 1 a rollout copy of the same architecture. Project: what the split runtime
runs — the sender's `broadcast_weights` (header, then parameters in flat buckets), the
receiver's `receive_weights` into its HF rollout engine's flat weight buffer, then
`push_weights` through the engine's `load_weights`. Four senders:
- `runtime`: a split run's lone actor as the runtime lays it out (`flatten_sender`: its
  parameters in one buffer, so every bucket goes as a view);
- `packed`: separate parameter tensors, packed into buckets: what a sender whose tensors
  are fresh every sync pays (a LoRA actor's merged weights);
- `fsdp`: the actor FSDP2-sharded over two trainer ranks (three processes; the second
  trainer rank joins the gathers, `join_send_gathers`): each bucket is gathered from the
  shards and sent (bucket_gather.py). Its floor is about two broadcasts, not one: the
  bytes cross once to gather and once to send;
- `direct`: the same sharded actor, each trainer rank sending its own rows straight to
  the receiver over a two-rank group (shard_sync.py): no gather, the bytes cross once.
Baseline: one `dist.broadcast` of a single pre-packed float32 tensor holding exactly as
many bytes — no header, no packing, no unpacking: the floor. Repetitions alternate; a
barrier before each timing lines the ranks up, and the time is the receiver's (its
weights are ready when it returns).

Reported: time ratio = project / plain (median, min-max). Target <= 1.3.
The receiver's weights are checked equal to the sender's after the project's sync, so a
fast but wrong sync cannot pass.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.roles.fsdp import shard_model
from verl_hpc.roles.rollout.hf import HFRolloutEngine
from verl_hpc.transport.weights.bucketed import (
    DEFAULT_BUCKET_BYTES,
    broadcast_weights,
    engine_buffer,
    join_send_gathers,
    push_weights,
    receive_weights,
    send_header,
    send_plan,
)
from verl_hpc.transport.weights.sender import flatten_sender
from verl_hpc.transport.weights.shard import ShardLinks, ShardReceiver, send_shards
from verl_hpc.utils.dtensor import full_tensor
from verl_hpc.utils.proc import exit_now

TARGET = 1.3


def _worker(rank: int, init_file: str, preset: str, reps: int, bucket_bytes: int, sender: str,
            out: str) -> None:
    """Rank 0 sends, the last rank receives; with sender `fsdp`, rank 1 holds the actor's other shard."""
    torch.set_num_threads(1)
    sharded = sender in ("fsdp", "direct")
    world = 3 if sharded else 2
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        trainers = dist.new_group([0, 1]) if sharded else None
        sync = dist.new_group([0, world - 1]) if sharded else dist.group.WORLD
        links = ShardLinks([dist.new_group([0, 2]), dist.new_group([1, 2])], [0, 1]) if sender == "direct" else None
        receiver, spec = rank == world - 1, PRESETS[preset]
        model = build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=1 if receiver else 0)
        numel = sum(p.numel() for p in model.parameters())
        if sender == "runtime" and rank == 0 and not flatten_sender(model):
            raise RuntimeError("the runtime would not flatten this actor: the bench's premise is wrong")
        if trainers is not None and not receiver:
            shard_model(model, trainers, "cpu")
        flat = torch.randn(numel) if rank == 0 else torch.empty(numel)
        engine = HFRolloutEngine(model, SimpleNamespace(pad_token_id=0, eos_token_id=1)) if receiver else None
        shards = ShardReceiver([p.shape for p in model.parameters()], links) if receiver and links else None
        rows: list[dict[str, float]] = []
        for rep in range(reps + 1):  # rep 0 warms both paths up and is dropped
            order = ("project", "plain") if rep % 2 == 0 else ("plain", "project")
            row: dict[str, float] = {}
            for method in order:
                dist.barrier()
                start = time.perf_counter()
                if method == "project" and links is not None and not receiver:
                    if rank == 0:
                        send_header(model, sync, 0, rep)
                    send_shards(model, send_plan(model, bucket_bytes), links.groups[rank])
                elif method == "project" and rank == 0:
                    broadcast_weights(model, sync, 0, rep, True, bucket_bytes=bucket_bytes)
                elif method == "project" and receiver:
                    _, tensors = receive_weights(engine.weight_specs(), sync, 0, bucket_bytes,  # type: ignore[union-attr]
                                                 into=engine_buffer(engine), shards=shards)
                    push_weights(tensors, engine, rep)  # type: ignore[arg-type]
                elif method == "project":
                    join_send_gathers(model, bucket_bytes)  # the other trainer rank: its part of the gathers
                elif rank == 0 or receiver:
                    dist.broadcast(flat, src=0, group=sync)
                row[f"{method}_s"] = time.perf_counter() - start
            if rep:
                rows.append(row)
        _check(model, engine, numel, rows, trainers, sync, rank, world, out)
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


def _check(model: torch.nn.Module, engine: HFRolloutEngine | None, numel: int, rows: list[dict[str, float]],
           trainers: dist.ProcessGroup | None, sync: dist.ProcessGroup, rank: int, world: int, out: str) -> None:
    """The receiver's weights against the sender's (gathered from the shards): written by the receiver."""
    if engine is not None:
        check = torch.cat([p.detach().reshape(-1) for p in engine.model.parameters()])
    elif trainers is not None:
        check = torch.cat([full_tensor(p.detach()).reshape(-1) for p in model.parameters()])
    else:
        check = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = check.clone()
    if rank in (0, world - 1):
        dist.broadcast(reference, src=0, group=sync)
    if rank == world - 1:
        torch.save({"rows": rows, "params": numel, "bytes": numel * 4,
                    "weights_equal": bool(torch.equal(check, reference))}, out)
    dist.barrier()  # no rank tears gloo down while another still uses it


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(preset: str, reps: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            sender: str = "runtime") -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="verl_hpc_bench_ws_") as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), preset, reps, bucket_bytes, sender, out),
                 nprocs=3 if sender in ("fsdp", "direct") else 2, join=True)
        data = torch.load(Path(out))
    rows = data["rows"]
    ratios = [r["project_s"] / r["plain_s"] for r in rows]
    return {"preset": preset, "sender": sender,
            "params": data["params"], "bytes": data["bytes"], "bucket_bytes": bucket_bytes,
            "weights_equal": data["weights_equal"], "project_s": _summary([r["project_s"] for r in rows]),
            "plain_s": _summary([r["plain_s"] for r in rows]), "ratio": _summary(ratios), "rows": rows}


def _key(case: dict[str, Any]) -> str:
    suffix = f"_{case['sender']}_sender" if case["sender"] != "runtime" else ""
    return f"bucketed_vs_plain_{case['preset']}{suffix}"


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    cases = [measure("tiny", 5), measure("tiny", 5, sender="packed"), measure("tiny", 3, sender="fsdp"),
             measure("tiny", 3, sender="direct")] if quick \
        else [measure("tiny", 9), measure("small", 15), measure("small", 15, sender="packed"),
              measure("small", 9, sender="fsdp"), measure("small", 9, sender="direct")]
    return {"quick": quick, "target": TARGET, "cases": cases, "ratios": {_key(c): c["ratio"] for c in cases}}


def table(result: dict[str, Any]) -> str:
    lines = ["weight sync benchmark: bucketed broadcast_weights vs one plain broadcast "
             "(gloo; 2 processes, 3 for fsdp and direct)",
             f"{'model':<8}{'sender':>11}{'params':>9}{'MB':>7}{'project s':>11}{'plain s':>10}{'ratio':>8}"
             f"{'min':>7}{'max':>7}  target  weights equal"]
    for c in result["cases"]:
        r = c["ratio"]
        ok = "met" if r["median"] <= TARGET else "MISSED"
        lines.append(f"{c['preset']:<8}{c['sender']:>11}{c['params'] / 1e6:>8.2f}M"
                     f"{c['bytes'] / 1e6:>7.1f}{c['project_s']['median']:>11.4f}{c['plain_s']['median']:>10.4f}"
                     f"{r['median']:>8.2f}{r['min']:>7.2f}{r['max']:>7.2f}  <= {TARGET} {ok}  {c['weights_equal']}")
    return "\n".join(lines)
