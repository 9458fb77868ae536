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

Fan-out, R rollout ranks (R + 1 processes): the runtime's chain (`broadcast_weights` with the
relay of transport/weights/chain.py) vs the same bucketed sync down gloo's binomial tree vs one plain
broadcast. Time: the slowest receiver's. Bytes: what rank 0's sockets put on the wire, counted by
the kernel (utils/wire_count.py), over the model's bytes — it must stay 1 as R grows. Targets:
chain <= 1.3x plain for every R, rank 0's bytes 1x the model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import summary
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
from verl_hpc.transport.weights.chain import chain_links, relay_for
from verl_hpc.transport.weights.sender import flatten_sender
from verl_hpc.transport.weights.shard import ShardLinks, ShardReceiver, send_shards
from verl_hpc.utils.dtensor import full_tensor
from verl_hpc.utils.proc import exit_now
from verl_hpc.utils.wire_count import tcp_bytes_sent

TARGET = 1.3
FANOUT_METHODS = ("chain", "tree", "plain")


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
            "weights_equal": data["weights_equal"], "project_s": summary([r["project_s"] for r in rows]),
            "plain_s": summary([r["plain_s"] for r in rows]), "ratio": summary(ratios), "rows": rows}


def _digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def _fanout_one(method: str, model: torch.nn.Module, flat: torch.Tensor, relay: Any, rank: int, rep: int) -> None:
    if method == "plain":
        dist.broadcast(flat, src=0)
    else:
        broadcast_weights(model, dist.group.WORLD, 0, rep, rank == 0, DEFAULT_BUCKET_BYTES,
                          relay=relay if method == "chain" else None)


def _fanout_worker(rank: int, world: int, init_file: str, preset: str, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        links = chain_links(0, list(range(1, world)))
        relay = relay_for(rank, links, [dist.new_group(ranks=pair) for pair in links])
        spec = PRESETS[preset]
        model = build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=0 if rank == 0 else rank)
        if rank == 0:
            flatten_sender(model)
        flat = torch.randn(sum(p.numel() for p in model.parameters()))
        counting = shutil.which("ss") is not None  # no iproute2: times only
        rows: list[dict[str, float]] = []
        for rep in range(reps + 1):  # rep 0 warms every path up and is dropped
            row: dict[str, float] = {}
            for method in FANOUT_METHODS[rep % 3:] + FANOUT_METHODS[:rep % 3]:
                dist.barrier()
                sent = tcp_bytes_sent(os.getpid()) if counting else 0
                start = time.perf_counter()
                _fanout_one(method, model, flat, relay, rank, rep)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                row[f"{method}_s"] = float(elapsed)
                row[f"{method}_bytes"] = tcp_bytes_sent(os.getpid()) - sent if counting else float("nan")
            if rep:
                rows.append(row)
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, _digest(model))
        if rank == 0:
            torch.save({"rows": rows, "bytes": flat.numel() * 4, "weights_equal": len(set(digests)) == 1}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


def measure_fanout(preset: str, receivers: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="verl_hpc_bench_fanout_") as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_fanout_worker, args=(receivers + 1, os.path.join(tmp, "init"), preset, reps, out),
                 nprocs=receivers + 1, join=True)
        data = torch.load(Path(out))
    rows, nbytes = data["rows"], data["bytes"]
    case: dict[str, Any] = {"preset": preset, "receivers": receivers, "bytes": nbytes,
                            "weights_equal": data["weights_equal"], "rows": rows}
    for method in FANOUT_METHODS:
        case[f"{method}_s"] = summary([r[f"{method}_s"] for r in rows])
        case[f"{method}_rank0_wire_x"] = statistics.median(r[f"{method}_bytes"] for r in rows) / nbytes
    for method in ("chain", "tree"):
        case[f"{method}_ratio"] = summary([r[f"{method}_s"] / r["plain_s"] for r in rows])
    return case


def _key(case: dict[str, Any]) -> str:
    suffix = f"_{case['sender']}_sender" if case["sender"] != "runtime" else ""
    return f"bucketed_vs_plain_{case['preset']}{suffix}"


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    cases = [measure("tiny", 5), measure("tiny", 5, sender="packed"), measure("tiny", 3, sender="fsdp"),
             measure("tiny", 3, sender="direct")] if quick \
        else [measure("tiny", 9), measure("small", 15), measure("small", 15, sender="packed"),
              measure("small", 9, sender="fsdp"), measure("small", 9, sender="direct")]
    fanout = [measure_fanout("tiny", r, 3) for r in (1, 2)] if quick else [measure_fanout("small", r, 5) for r in (1, 2, 4)]
    ratios = {_key(c): c["ratio"] for c in cases}
    ratios.update({f"{m}_vs_plain_{c['preset']}_r{c['receivers']}": c[f"{m}_ratio"] for c in fanout
                   for m in ("chain", "tree")})
    return {"quick": quick, "target": TARGET, "cases": cases, "fanout": fanout, "ratios": ratios}


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
    return "\n".join(lines + _fanout_lines(result.get("fanout", [])))


def _fanout_lines(cases: list[dict[str, Any]]) -> list[str]:
    lines = ["fan-out: the chain vs gloo's broadcast tree vs one plain broadcast (gloo, R + 1 processes)",
             f"{'model':<7}{'R':>3}{'MB':>7}{'plain s':>9}{'chain s':>9}{'tree s':>9}{'chain/plain':>12}"
             f"{'tree/plain':>11}  rank-0 bytes / model: chain, tree, plain   target  equal"]
    for c in cases:
        ratio = c["chain_ratio"]["median"]
        ok = "met" if ratio <= TARGET else "MISSED"
        lines.append(f"{c['preset']:<7}{c['receivers']:>3}{c['bytes'] / 1e6:>7.1f}{c['plain_s']['median']:>9.4f}"
                     f"{c['chain_s']['median']:>9.4f}{c['tree_s']['median']:>9.4f}{ratio:>12.2f}"
                     f"{c['tree_ratio']['median']:>11.2f}  {c['chain_rank0_wire_x']:>5.2f} {c['tree_rank0_wire_x']:>5.2f} "
                     f"{c['plain_rank0_wire_x']:>5.2f}{'':>19}<= {TARGET} {ok}  {c['weights_equal']}")
    return lines
