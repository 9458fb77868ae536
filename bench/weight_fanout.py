"""The weight sync to R rollout ranks: the runtime's chain vs gloo's broadcast tree vs one plain broadcast.

R + 1 processes on gloo (loopback): rank 0 holds the actor, laid out as a split run's lone
actor is (`flatten_sender`: one buffer, buckets sent as views), ranks 1..R a rollout copy each.
Three ways to move the same weights, alternating in each repetition after a barrier:
- chain: what the split runtime runs with several rollout ranks (`broadcast_weights` with
  the relay of transport/weights/chain.py; one receiver: the sync group itself is the pair);
- tree: the same bucketed sync without the relay (gloo's binomial broadcast tree: what
  the runtime ran before);
- plain: one `dist.broadcast` of a pre-packed float32 tensor of the same bytes (the floor
  the issue sets the target against: <= 1.3x).
Time: the slowest receiver's (every rank's weights are ready then). Bytes: what rank 0's
sockets put on the wire, counted by the kernel (utils/wire_count.py), over the model's bytes
— the number that must stay 1 as R grows. Receivers are checked equal to the sender.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.transport.weights.bucketed import DEFAULT_BUCKET_BYTES, broadcast_weights
from verl_hpc.transport.weights.chain import chain_links, relay_for
from verl_hpc.transport.weights.sender import flatten_sender
from verl_hpc.utils.proc import exit_now
from verl_hpc.utils.wire_count import tcp_bytes_sent

TARGET = 1.3
METHODS = ("chain", "tree", "plain")


def _digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def _one(method: str, model: torch.nn.Module, flat: torch.Tensor, relay: Any, rank: int, rep: int) -> None:
    if method == "plain":
        dist.broadcast(flat, src=0)
    else:
        broadcast_weights(model, dist.group.WORLD, 0, rep, rank == 0, DEFAULT_BUCKET_BYTES,
                          relay=relay if method == "chain" else None)


def _worker(rank: int, world: int, init_file: str, preset: str, reps: int, out: str) -> None:
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
            for method in METHODS[rep % 3:] + METHODS[:rep % 3]:
                dist.barrier()
                sent = tcp_bytes_sent(os.getpid()) if counting else 0
                start = time.perf_counter()
                _one(method, model, flat, relay, rank, rep)
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


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(preset: str, receivers: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="verl_hpc_bench_fanout_") as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(receivers + 1, os.path.join(tmp, "init"), preset, reps, out),
                 nprocs=receivers + 1, join=True)
        data = torch.load(Path(out))
    rows, nbytes = data["rows"], data["bytes"]
    case: dict[str, Any] = {"preset": preset, "receivers": receivers, "bytes": nbytes,
                            "weights_equal": data["weights_equal"], "rows": rows}
    for method in METHODS:
        case[f"{method}_s"] = _summary([r[f"{method}_s"] for r in rows])
        case[f"{method}_rank0_wire_x"] = statistics.median(r[f"{method}_bytes"] for r in rows) / nbytes
    for method in ("chain", "tree"):
        case[f"{method}_ratio"] = _summary([r[f"{method}_s"] / r["plain_s"] for r in rows])
    return case


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    cases = [measure("tiny", r, 3) for r in (1, 2)] if quick else [measure("small", r, 5) for r in (1, 2, 4)]
    ratios = {f"{m}_vs_plain_{c['preset']}_r{c['receivers']}": c[f"{m}_ratio"] for c in cases for m in ("chain", "tree")}
    return {"quick": quick, "target": TARGET, "cases": cases, "ratios": ratios}


def table(result: dict[str, Any]) -> str:
    lines = ["weight fan-out benchmark: the chain vs gloo's broadcast tree vs one plain broadcast (gloo, R + 1 processes)",
             f"{'model':<7}{'R':>3}{'MB':>7}{'plain s':>9}{'chain s':>9}{'tree s':>9}{'chain/plain':>12}"
             f"{'tree/plain':>11}  rank-0 bytes / model: chain, tree, plain   target  equal"]
    for c in result["cases"]:
        ratio = c["chain_ratio"]["median"]
        ok = "met" if ratio <= TARGET else "MISSED"
        lines.append(f"{c['preset']:<7}{c['receivers']:>3}{c['bytes'] / 1e6:>7.1f}{c['plain_s']['median']:>9.4f}"
                     f"{c['chain_s']['median']:>9.4f}{c['tree_s']['median']:>9.4f}{ratio:>12.2f}"
                     f"{c['tree_ratio']['median']:>11.2f}  {c['chain_rank0_wire_x']:>5.2f} {c['tree_rank0_wire_x']:>5.2f} "
                     f"{c['plain_rank0_wire_x']:>5.2f}{'':>19}<= {TARGET} {ok}  {c['weights_equal']}")
    return "\n".join(lines)
