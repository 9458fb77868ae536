"""The rollout transport across processes: a producer process puts, the trainer process takes.

Why apart from `transport.py`: there the producer is a thread of the trainer's own process,
so every acknowledgement is a hand-over of Python's GIL between two busy threads, which on
this 2-vCPU VM costs more than moving 64 KB. In a run the producer is another process
(a rollout rank), so this is the measurement that matches issue 19's target ("same node
and across processes"). Routes, as in `transport.py`: "flight" (the gRPC stream), "local"
(the same-node Unix socket), and the baseline, length-prefixed bytes over one loopback TCP
connection answered with one byte. Beside them, two Python receivers that keep only the
route's unavoidable hand-offs (`transport_floor.py`): what no Python design can beat. The
producer times `transfers` puts (each returns once the trainer has the batch in its
buffer); a consumer thread in the trainer takes batches off the buffer throughout, as the
trainer does.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import statistics
import threading
import time
from typing import Any

from bench.native_receiver import NativeReceiver
from bench.transport import RawLoopback, _label, ipc_bytes, make_batch, transfers_per_rep
from bench.transport_floor import MODES as FLOOR_MODES
from bench.transport_floor import FloorReceiver, FloorSender
from verl_hpc.transport.rollouts.flight import RolloutFlightClient, RolloutFlightServer
from verl_hpc.transport.rollouts.local import LocalConnection

TOKEN = "bench-procs"
ROUTES = ("flight", "local")


def _producer(location: str, local_location: str, raw_port: int, floor_paths: dict[str, str],
              native_path: str | None, nbytes: int, reps: int, transfers: int, out: Any) -> None:
    """The child: alternate the routes, the raw socket and the floors; send back the seconds per transfer."""
    batch = make_batch(nbytes)
    payload = ipc_bytes(batch)
    clients = {"flight": RolloutFlightClient(location, TOKEN, "procs-flight"),
               "local": RolloutFlightClient(location, TOKEN, "procs-local", local_location=local_location)}
    raw = RawLoopback.connect_to(raw_port)
    floors = {mode: FloorSender(path) for mode, path in floor_paths.items()}
    sends = {**{name: (lambda c=client: c.put(batch)) for name, client in clients.items()},
             "raw": lambda: raw.send(payload), **{mode: (lambda f=f: f.send(payload)) for mode, f in floors.items()}}
    if native_path is not None:  # the route's own client end, into the C receiver (native_receiver.py)
        native, numbers = LocalConnection(native_path, TOKEN, "procs-native"), itertools.count()
        sends["native"] = lambda: native.send(batch.record_batch, next(numbers), None)
    times: dict[str, list[float]] = {name: [] for name in sends}
    try:
        for rep in range(reps + 1):  # rep 0 warms up every path and is dropped
            n = transfers if rep else 1
            for name, send in sends.items():
                start = time.perf_counter()
                for _ in range(n):
                    send()
                if rep:
                    times[name].append((time.perf_counter() - start) / n)
        out.send({"times": times, "same_node": clients["local"].same_node, "bytes": len(payload),
                  "rows": len(batch)})
    finally:
        for client in clients.values():
            client.close()
        for floor in floors.values():
            floor.close()
        raw.close()


def measure_size(nbytes: int, reps: int, native: bool = False) -> dict[str, Any]:
    """One size's ratios; `native`: also the C receiver of bench/native_receiver.c (needs a compiler)."""
    transfers = transfers_per_rep(nbytes)
    server = RolloutFlightServer(token=TOKEN, capacity=2, local=True)
    raw = RawLoopback(nbytes * 2, connect=False)
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            try:
                server.get(timeout=0.2)
            except (TimeoutError, RuntimeError):
                continue

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    floors = {mode: FloorReceiver(mode) for mode in FLOOR_MODES}
    receiver = NativeReceiver(TOKEN, capacity=2) if native else None
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_producer, args=(server.location, server.local_location, raw.port,
                                                {mode: f.path for mode, f in floors.items()},
                                                receiver.path if receiver else None, nbytes, reps, transfers,
                                                child_end))
    try:
        child.start()
        result = parent_end.recv()
        child.join(timeout=60)
    finally:
        stop.set()
        consumer.join(timeout=5)
        server.shutdown()
        raw.close()
        for floor in floors.values():
            floor.close()
        if receiver is not None:
            receiver.close()
    if not result["same_node"]:
        raise RuntimeError("the producer did not take the same-node socket (VERL_HPC_ROLLOUT_LOCAL=0?)")
    times = result["times"]
    row: dict[str, Any] = {"bytes": result["bytes"], "rows": result["rows"], "transfers_per_rep": transfers,
                           "raw_mb_s": result["bytes"] / statistics.median(times["raw"]) / 1e6}
    for name in (*ROUTES, *FLOOR_MODES, *(["native"] if native else [])):
        row[f"{name}_ratio"] = _ratios(times["raw"], times[name])
        row[f"{name}_mb_s"] = result["bytes"] / statistics.median(times[name]) / 1e6
    row["local_vs_floor"] = _ratios(times["floor"], times["local"])
    if receiver is not None:
        row["native_vs_local"] = _ratios(times["local"], times["native"])
        row["native_taken"], row["native_out_of_order"] = receiver.taken, receiver.out_of_order
    return row


def _ratios(baseline: list[float], measured: list[float]) -> dict[str, float]:
    """Baseline time / measured time per alternating repetition: the throughput ratio."""
    ratios = [b / m for b, m in zip(baseline, measured, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def measure(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    return [measure_size(size, reps) for size in sizes]


def table_lines(rows: list[dict[str, Any]], target: Any) -> list[str]:
    lines = ["across processes (a producer process puts, the trainer process takes):",
             f"{'batch (IPC bytes)':<18}{'rows':>6}{'raw MB/s':>10}{'Flight MB/s':>12}{'ratio':>7}"
             f"{'local MB/s':>11}{'ratio':>7}{'min':>6}{'max':>6}  target (local)"]
    for row in rows:
        local_r, goal = row["local_ratio"], target(row["bytes"])
        ok = "met" if local_r["median"] >= goal else "MISSED"
        lines.append(f"{_label(row['bytes']):<18}{row['rows']:>6}{row['raw_mb_s']:>10.0f}{row['flight_mb_s']:>12.0f}"
                     f"{row['flight_ratio']['median']:>7.2f}{row['local_mb_s']:>11.0f}{local_r['median']:>7.2f}"
                     f"{local_r['min']:>6.2f}{local_r['max']:>6.2f}  >= {goal} {ok}")
    lines += ["the floor under those ratios (bench/transport_floor.py), each against the same raw TCP socket:",
              f"{'batch (IPC bytes)':<18}{'raw Unix':>10}{'floor':>7}{'local / floor':>15}"]
    for row in rows:
        lines.append(f"{_label(row['bytes']):<18}{row['unix_ratio']['median']:>10.2f}{row['floor_ratio']['median']:>7.2f}"
                     f"{row['local_vs_floor']['median']:>15.2f}")
    return lines
