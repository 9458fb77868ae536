"""Rollout batches over the project's two routes vs the same bytes over a raw socket.

Project: `RolloutFlightClient.put(batch)` into a `RolloutFlightServer` on loopback, then
`server.get()` — authenticated, numbered, schema-checked, deduplicated, acknowledged:
everything a run pays to move one rollout batch from a worker to the trainer. Two routes, as
a run takes them: "flight", the client's one open `do_exchange` stream (a producer on another
node), and "local", the Unix socket a producer on the trainer's own node uses (same client,
same server). Baseline: the same number of bytes (the batch's Arrow IPC stream) sent with
`sendall` over one persistent loopback TCP connection to a thread that `recv_into`s a buffer
and answers one acknowledgement byte — the floor any transport on this host can reach.

Measured twice: in one process (the producer a thread of the trainer's process), and across
processes (a producer process puts, the trainer process takes, a consumer thread draining its
buffer as the trainer does) — the second is what a run does: a rollout rank is a process.
Both sides keep their connection open and wait for the acknowledgement, so each time is "sent
and known delivered". Small batches repeat several transfers per timing (`transfers_per_rep`:
up to 256, ~64 MB a timing) so each timing is a steady stream, not a burst that catches the
VM's idle vCPUs waking up. Reported per size: throughput ratio = raw time / route time
(median, min-max over alternating repetitions). Targets: >= 0.8 from 1 MB, >= 0.5 below.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from bench import summary
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts.flight import RolloutFlightClient, RolloutFlightServer

TARGET = 0.8
SMALL_TARGET, SMALL_BELOW = 0.5, 1 << 20  # below 1 MB the target is 0.5
FULL_SIZES = [64 << 10, 1 << 20, 16 << 20, 256 << 20]
QUICK_SIZES = [64 << 10, 1 << 20, 4 << 20]
PROMPT_LEN, RESPONSE_LEN = 128, 512


def make_batch(nbytes: int, seed: int = 0) -> RolloutBatch:
    """A realistic rollout batch (prompt + response ids, rollout logprobs) of about `nbytes`."""
    row_bytes = 4 * PROMPT_LEN + 8 * RESPONSE_LEN + 64
    rows = max(1, round(nbytes / row_bytes))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(2, 32000, size=(rows, PROMPT_LEN), dtype=np.int32)
    responses = rng.integers(2, 32000, size=(rows, RESPONSE_LEN), dtype=np.int32)
    logprobs = -rng.random((rows, RESPONSE_LEN), dtype=np.float32)
    return RolloutBatch.from_generation(list(prompts), list(responses), list(logprobs),
                                        group_ids=[i // 8 for i in range(rows)], prompt_index=list(range(rows)),
                                        ground_truth=["42"] * rows, policy_version=0)


def ipc_bytes(batch: RolloutBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.record_batch.schema) as writer:
        writer.write_batch(batch.record_batch)
    return sink.getvalue().to_pybytes()


class RawLoopback:
    """Length-prefixed bytes over one loopback TCP connection, acknowledged with one byte."""

    def __init__(self, capacity: int, connect: bool = True) -> None:
        """A receiving thread on a fresh port; `connect=False`: the sender is another process
        (`connect_to(port)` there)."""
        self._listener: socket.socket | None = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._buffer = bytearray(capacity)
        self._thread: threading.Thread | None = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._conn = self._dial(self.port) if connect else None

    @classmethod
    def connect_to(cls, port: int) -> RawLoopback:
        """The sending end only, for a receiver in another process."""
        raw = cls.__new__(cls)
        raw._listener, raw._thread, raw.port = None, None, port
        raw._conn = cls._dial(port)
        return raw

    @staticmethod
    def _dial(port: int) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _serve(self) -> None:
        conn, _ = self._listener.accept()  # type: ignore[union-attr]
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(self._buffer)
        with conn:
            while True:
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                size, got = struct.unpack("!Q", header)[0], 0
                while got < size:
                    n = conn.recv_into(view[got:size])
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"\x01")

    def send(self, payload: bytes) -> None:
        conn = self._conn
        assert conn is not None, "a receiving-only RawLoopback cannot send"
        conn.sendall(struct.pack("!Q", len(payload)))
        conn.sendall(payload)
        if conn.recv(1) != b"\x01":
            raise RuntimeError("raw loopback receiver closed the connection")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()


def _time_flight(client: RolloutFlightClient, server: RolloutFlightServer, batch: RolloutBatch,
                 transfers: int) -> float:
    start = time.perf_counter()
    for _ in range(transfers):
        client.put(batch)
        server.get(timeout=60)
    return time.perf_counter() - start


def _time_raw(raw: RawLoopback, payload: bytes, transfers: int) -> float:
    start = time.perf_counter()
    for _ in range(transfers):
        raw.send(payload)
    return time.perf_counter() - start


def transfers_per_rep(nbytes: int) -> int:
    """How many puts one timing holds: ~64 MB of batches, at most 256 and at least one."""
    return max(1, min(256, (64 << 20) // nbytes))


def measure_size(nbytes: int, reps: int) -> dict[str, Any]:
    """Alternating flight / local / raw repetitions for one batch size (first round is a warm-up)."""
    batch = make_batch(nbytes)
    payload = ipc_bytes(batch)
    transfers = transfers_per_rep(len(payload))
    raw = RawLoopback(len(payload))
    server = RolloutFlightServer(token="bench", capacity=2, local=True)
    clients = {"flight": RolloutFlightClient(server.location, "bench", "bench-flight"),
               "local": RolloutFlightClient(server.location, "bench", "bench-local",
                                            local_location=server.local_location)}
    if not clients["local"].same_node:
        raise RuntimeError("the same-node route is off (VERL_HPC_ROLLOUT_LOCAL=0?): nothing to measure")
    times: dict[str, list[float]] = {"flight": [], "local": [], "raw": []}
    try:
        for rep in range(reps + 1):
            for route, client in clients.items():
                elapsed = _time_flight(client, server, batch, transfers if rep else 1) / (transfers if rep else 1)
                if rep:
                    times[route].append(elapsed)
            elapsed = _time_raw(raw, payload, transfers if rep else 1) / (transfers if rep else 1)
            if rep:
                times["raw"].append(elapsed)
    finally:
        for client in clients.values():
            client.close()
        server.shutdown()
        raw.close()
    row: dict[str, Any] = {"bytes": len(payload), "rows": len(batch), "transfers_per_rep": transfers,
                           "raw_s": summary(times["raw"]),
                           "raw_mb_s": len(payload) / statistics.median(times["raw"]) / 1e6}
    for route in ("flight", "local"):
        row[f"{route}_s"] = summary(times[route])
        row[f"{route}_mb_s"] = len(payload) / statistics.median(times[route]) / 1e6
        row[f"{route}_ratio"] = summary([r / t for r, t in zip(times["raw"], times[route], strict=True)])
    row["ratio"] = row["flight_ratio"]  # the name older results used
    return row


def target(nbytes: int) -> float:
    return SMALL_TARGET if nbytes < SMALL_BELOW else TARGET


def _producer(location: str, local_location: str, raw_port: int, nbytes: int, reps: int, transfers: int,
              out: Any) -> None:
    """The producer process: alternate the two routes and the raw socket; send back seconds per transfer."""
    batch = make_batch(nbytes)
    payload = ipc_bytes(batch)
    clients = {"flight": RolloutFlightClient(location, "bench", "procs-flight"),
               "local": RolloutFlightClient(location, "bench", "procs-local", local_location=local_location)}
    raw = RawLoopback.connect_to(raw_port)
    sends = {**{name: (lambda c=client: c.put(batch)) for name, client in clients.items()},
             "raw": lambda: raw.send(payload)}
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
        out.send({"times": times, "same_node": clients["local"].same_node, "bytes": len(payload), "rows": len(batch)})
    finally:
        for client in clients.values():
            client.close()
        raw.close()


def measure_across_processes(nbytes: int, reps: int) -> dict[str, Any]:
    """One size, the producer in a process of its own and the trainer's consumer thread taking throughout."""
    server = RolloutFlightServer(token="bench", capacity=2, local=True)
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
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_producer, args=(server.location, server.local_location, raw.port, nbytes, reps,
                                                transfers_per_rep(nbytes), child_end))
    try:
        child.start()
        result = parent_end.recv()
        child.join(timeout=60)
    finally:
        stop.set()
        consumer.join(timeout=5)
        server.shutdown()
        raw.close()
    if not result["same_node"]:
        raise RuntimeError("the producer did not take the same-node socket (VERL_HPC_ROLLOUT_LOCAL=0?)")
    times = result["times"]
    row: dict[str, Any] = {"bytes": result["bytes"], "rows": result["rows"],
                           "raw_mb_s": result["bytes"] / statistics.median(times["raw"]) / 1e6}
    for route in ("flight", "local"):
        row[f"{route}_ratio"] = summary([r / t for r, t in zip(times["raw"], times[route], strict=True)])
        row[f"{route}_mb_s"] = result["bytes"] / statistics.median(times[route]) / 1e6
    return row


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    # 15 full repetitions: a run takes ~20 s, and on a shared 2-core host a 7-rep median moved by 0.3
    sizes, reps = (QUICK_SIZES, 3) if quick else (FULL_SIZES, 15)
    rows = [measure_size(size, reps if size < (64 << 20) else max(3, reps - 2)) for size in sizes]
    procs = [measure_across_processes(size, reps) for size in sizes]
    ratios = {f"{route}_vs_raw_{_label(r['bytes'])}{suffix}": r[f"{route}_ratio"]
              for suffix, table_rows in (("", rows), ("_across_processes", procs))
              for r in table_rows for route in ("flight", "local")}
    return {"quick": quick, "reps": reps, "target": TARGET, "small_target": SMALL_TARGET, "sizes": rows,
            "across_processes": procs, "ratios": ratios}


def _label(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f}MB" if nbytes >= (1 << 20) else f"{nbytes >> 10}KB"


def _rows(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'batch (IPC bytes)':<18}{'rows':>6}{'raw MB/s':>10}{'Flight MB/s':>12}{'ratio':>7}"
             f"{'local MB/s':>11}{'ratio':>7}{'min':>6}{'max':>6}  target (local)"]
    for row in rows:
        flight_r, local_r, goal = row["flight_ratio"], row["local_ratio"], target(row["bytes"])
        ok = "met" if local_r["median"] >= goal else "MISSED"
        lines.append(f"{_label(row['bytes']):<18}{row['rows']:>6}{row['raw_mb_s']:>10.0f}{row['flight_mb_s']:>12.0f}"
                     f"{flight_r['median']:>7.2f}{row['local_mb_s']:>11.0f}{local_r['median']:>7.2f}"
                     f"{local_r['min']:>6.2f}{local_r['max']:>6.2f}  >= {goal} {ok}")
    return lines


def table(result: dict[str, Any]) -> str:
    return "\n".join([f"transport benchmark: put+get over Flight and over the same-node socket vs a raw loopback "
                      f"socket, {result['reps']} alternating reps",
                      "in one process (the producer is a thread of the trainer's process):", *_rows(result["sizes"]),
                      "across processes (a producer process puts, the trainer process takes):",
                      *_rows(result.get("across_processes", []))])
