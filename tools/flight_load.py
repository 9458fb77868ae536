"""Load on the rollout path: many concurrent Flight producers into one bounded buffer.

    .venv/bin/python tools/flight_load.py                                   # 32 producers, docs/reliability.md
    .venv/bin/python tools/flight_load.py --producers 4 --batches 3 --tokens 65536  # few, large batches
    .venv/bin/python tools/flight_load.py --route local                     # over the same-node socket

Every batch is generated from (producer, index), hashed by the producer before sending and by
the consumer on arrival; the report says how many arrived, whether the multiset of hashes is the
same (nothing lost, nothing twice), how full the buffer got (never above its capacity), how many
puts were blocked at once (backpressure), and the process's peak memory growth next to the bytes
sent (memory stays bounded by the buffer, not by the traffic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from verl_hpc.data.rollout_batch import RolloutBatch  # noqa: E402
from verl_hpc.transport.rollouts import RolloutFlightClient, RolloutFlightServer  # noqa: E402

TOKEN = "f" * 64


def make_batch(producer: int, index: int, rows: int, tokens: int) -> RolloutBatch:
    rng = np.random.default_rng(producer * 1_000_003 + index)
    lengths = rng.integers(max(1, tokens // 2), tokens + 1, size=rows)
    responses = [rng.integers(0, 32000, size=int(n), dtype=np.int32) for n in lengths]
    return RolloutBatch.from_generation(
        prompt_ids=[[producer, index]] * rows, response_ids=responses,
        rollout_logprobs=[np.full(int(n), -0.5, dtype=np.float32) for n in lengths],
        group_ids=[producer] * rows, prompt_index=[index * rows + r for r in range(rows)],
        ground_truth=[f"{producer}:{index}"] * rows, policy_version=index)


def digest(batch: RolloutBatch) -> str:
    """The batch's content, independent of how Flight chunked it on the wire."""
    h = hashlib.sha256()
    for name in ("prompt_index", "group_id", "policy_version", "ground_truth", "response_ids", "rollout_logprobs"):
        col = batch.column(name)
        col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        if hasattr(col, "offsets"):
            h.update(np.diff(col.offsets.to_numpy()).tobytes())
            col = col.flatten()
        h.update(np.asarray(col.to_numpy(zero_copy_only=False)).tobytes() if name != "ground_truth"
                 else "\0".join(col.to_pylist()).encode())
    return h.hexdigest()


def run_load(producers: int = 32, batches: int = 8, rows: int = 64, tokens: int = 1024, capacity: int = 4,
             timeout_s: float = 300.0, route: str = "flight") -> dict:
    """Run one load test on loopback; returns the figures (see the module docstring)."""
    process = psutil.Process()
    base_rss = process.memory_info().rss
    sent: list[str] = []
    sent_lock, errors = threading.Lock(), []
    peak = {"rss": base_rss, "queued": 0, "waiting": 0}
    done = threading.Event()

    with RolloutFlightServer(token=TOKEN, capacity=capacity, local=route == "local") as server:
        def produce(p: int) -> None:
            try:
                with RolloutFlightClient(f"grpc://127.0.0.1:{server.port}", TOKEN, f"producer-{p}",
                                         local_location=server.local_location) as client:
                    if client.same_node != (route == "local"):
                        raise RuntimeError(f"asked for route {route!r}, the client took the other")
                    for i in range(batches):
                        batch = make_batch(p, i, rows, tokens)  # made when sent: memory is not the whole load
                        with sent_lock:
                            sent.append(digest(batch))
                        client.put(batch)
            except Exception as err:  # noqa: BLE001 - reported, not raised in a thread
                errors.append(f"producer {p}: {err}")

        def watch() -> None:
            while not done.is_set():
                stats = server.stats()
                peak["rss"] = max(peak["rss"], process.memory_info().rss)
                peak["queued"] = max(peak["queued"], stats["queued"])
                peak["waiting"] = max(peak["waiting"], stats["waiting_puts"])
                time.sleep(0.005)

        threads = [threading.Thread(target=produce, args=(p,), daemon=True) for p in range(producers)]
        watcher = threading.Thread(target=watch, daemon=True)
        start = time.monotonic()
        watcher.start()
        for t in threads:
            t.start()
        received, nbytes = [], 0
        for _ in range(producers * batches):
            batch = server.get(timeout=timeout_s)
            nbytes += batch.record_batch.nbytes
            received.append(digest(batch))
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(timeout=30)
        done.set()
        watcher.join()
        stats = server.stats()
    lost = Counter(sent) - Counter(received)
    extra = Counter(received) - Counter(sent)
    return {"producers": producers, "batches_sent": len(sent), "batches_received": len(received),
            "lost": sum(lost.values()), "duplicated_or_unknown": sum(extra.values()),
            "server_duplicates": stats["duplicates"], "errors": errors, "capacity": capacity, "route": route,
            "local_batches": stats.get("local_batches", 0),
            "max_queued": peak["queued"], "max_blocked_puts": peak["waiting"],
            "mib_sent": round(nbytes / 2**20, 1), "peak_rss_growth_mib": round((peak["rss"] - base_rss) / 2**20, 1),
            "batch_mib": round(nbytes / max(1, len(received)) / 2**20, 2),
            "seconds": round(elapsed, 2), "mib_per_s": round(nbytes / 2**20 / elapsed, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=32)
    parser.add_argument("--batches", type=int, default=8, help="per producer")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024, help="at most this many response tokens per row")
    parser.add_argument("--capacity", type=int, default=4, help="the server's buffer, in batches")
    parser.add_argument("--route", choices=("flight", "local"), default="flight",
                        help="local: producers use the same-node Unix socket (transport/rollouts/local.py)")
    args = parser.parse_args(argv)
    result = run_load(args.producers, args.batches, args.rows, args.tokens, args.capacity, route=args.route)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    figures = main()
    sys.exit(0 if figures["lost"] == figures["duplicated_or_unknown"] == 0 and not figures["errors"] else 1)
