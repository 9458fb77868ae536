"""Rollout batches over the project's Arrow Flight path vs the same bytes over a raw socket.

Project: `RolloutFlightClient.put(batch)` into a `RolloutFlightServer` on loopback, then
`server.get()` — authenticated, numbered, schema-checked, deduplicated, acknowledged:
everything a run pays to move one rollout batch from a worker to the trainer. The
client's puts travel on its one open `do_exchange` stream, as they do in a run.
Baseline: the same number of bytes (the batch's Arrow IPC stream) sent with `sendall`
over one persistent loopback TCP connection to a thread that `recv_into`s a buffer and
answers one acknowledgement byte — the floor any transport on this host can reach.

Both sides keep their connection open across repetitions (a run's workers do too) and
wait for the receiver's acknowledgement, so each time is "sent and known delivered".
Small batches repeat several transfers per timing so the timer sees more than jitter.
Reported per size: throughput ratio = raw time / Flight time (median, min-max over
alternating repetitions). Target >= 0.8: Flight may cost at most a fifth of the wire.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.data.transport.flight import RolloutFlightClient, RolloutFlightServer

TARGET = 0.8
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

    def __init__(self, capacity: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._buffer = bytearray(capacity)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._conn = socket.create_connection(self._listener.getsockname())
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
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
        self._conn.sendall(struct.pack("!Q", len(payload)))
        self._conn.sendall(payload)
        if self._conn.recv(1) != b"\x01":
            raise RuntimeError("raw loopback receiver closed the connection")

    def close(self) -> None:
        self._conn.close()
        self._thread.join(timeout=5)
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


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_size(nbytes: int, reps: int) -> dict[str, Any]:
    """Alternating Flight / raw repetitions for one batch size (first pair is a discarded warm-up)."""
    batch = make_batch(nbytes)
    payload = ipc_bytes(batch)
    transfers = max(1, min(32, (16 << 20) // len(payload)))
    raw = RawLoopback(len(payload))
    server = RolloutFlightServer(token="bench", capacity=2)
    client = RolloutFlightClient(server.location, "bench", "bench-producer")
    try:
        _time_flight(client, server, batch, 1)
        _time_raw(raw, payload, 1)
        flight_s, raw_s = [], []
        for _ in range(reps):
            flight_s.append(_time_flight(client, server, batch, transfers) / transfers)
            raw_s.append(_time_raw(raw, payload, transfers) / transfers)
    finally:
        client.close()
        server.shutdown()
        raw.close()
    ratios = [r / f for r, f in zip(raw_s, flight_s, strict=True)]
    return {"bytes": len(payload), "rows": len(batch), "transfers_per_rep": transfers,
            "flight_s": _summary(flight_s), "raw_s": _summary(raw_s), "ratio": _summary(ratios),
            "flight_mb_s": len(payload) / statistics.median(flight_s) / 1e6,
            "raw_mb_s": len(payload) / statistics.median(raw_s) / 1e6}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    # 15 full repetitions: a run takes ~20 s, and on a shared 2-core host a 7-rep median moved by 0.3
    sizes, reps = (QUICK_SIZES, 3) if quick else (FULL_SIZES, 15)
    rows = [measure_size(size, reps if size < (64 << 20) else max(3, reps - 2)) for size in sizes]
    return {"quick": quick, "reps": reps, "target": TARGET, "sizes": rows,
            "ratios": {f"flight_vs_raw_{_label(r['bytes'])}": r["ratio"] for r in rows}}


def _label(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f}MB" if nbytes >= (1 << 20) else f"{nbytes >> 10}KB"


def table(result: dict[str, Any]) -> str:
    lines = [f"transport benchmark: Flight put+get vs raw loopback socket, {result['reps']} alternating reps",
             f"{'batch (IPC bytes)':<18}{'rows':>6}{'Flight MB/s':>12}{'raw MB/s':>10}"
             f"{'ratio':>8}{'min':>7}{'max':>7}  target"]
    for row in result["sizes"]:
        r = row["ratio"]
        ok = "met" if r["median"] >= TARGET else "MISSED"
        lines.append(f"{_label(row['bytes']):<18}{row['rows']:>6}{row['flight_mb_s']:>12.0f}{row['raw_mb_s']:>10.0f}"
                     f"{r['median']:>8.2f}{r['min']:>7.2f}{r['max']:>7.2f}  >= {TARGET} {ok}")
    return "\n".join(lines)
