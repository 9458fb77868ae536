"""Rollouts go straight from the producer to the trainer rank that trains them: no rank-0 funnel.

Why: with one Flight endpoint on trainer rank 0, every rollout byte of a step crossed that
rank's NIC twice — in from the producers, out again in its broadcast to every other rank
(OpenRLHF#533 measured the broadcast at > 40% of a step; NeMo-RL#945 hit the same wall at
≥ 512 GPUs). Here every trainer rank serves its own endpoint. A producer knows, from the
pure layout of data/layout.py, which rank holds each row (`row_owner`), so it splits its
batch and puts each part to its owner. Whole prompt groups land on one rank whenever the
estimator needs them to (`whole_groups`, checked by the config), so group advantages need
no gather. A rank receives only its own rows: O(batch / W) bytes per rank per step.

What each side holds (through the transport's two ends, base.py):
- `TrainerIntake` (every trainer rank): its receiver, and the batches it has received,
  filed by step key until it has all `expected` rows of a key.
- `RolloutRouter` (every rollout rank): one sender per trainer rank; `put` sends each
  owner its part at the same time, skipping ranks that get no rows of this batch.

The dedup, back-pressure and reconnect guarantees are the transport's own
(transport/rollouts/), now per (producer, trainer rank) pair; the run secret is the same.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import pyarrow as pa

from verl_hpc.data.rollout_batch import SCHEMA, RolloutBatch
from verl_hpc.transport.rollouts.base import RolloutSender

BUFFER_FILE = "rollout_buffer.arrow"  # a rank's rollouts generated ahead (max_staleness > 0), Arrow IPC


def bind_host(master_addr: str, is_leader: bool) -> str:
    """Where a trainer rank's endpoint listens.

    The leader binds the job's first host, as it always has. Another rank binds the same
    address when that is a loopback one (the whole job is on one machine); else it binds
    every interface and is advertised by this node's hostname (`RolloutFlightServer.location`):
    Slurm's node names need not resolve (a local cluster's do not), its hostnames do.
    The endpoint takes only clients that present the run's secret.
    """
    if is_leader or _loopback(master_addr):
        return master_addr
    return "0.0.0.0"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TrainerIntake:
    """One trainer rank's Flight endpoint and what it received, filed by step key."""

    def __init__(self, host: str, token: str, capacity: int = 8) -> None:
        from verl_hpc.transport.rollouts import RolloutFlightServer

        # local: producers on this node skip gRPC (transport/rollouts/local.py), same contract
        self.server = RolloutFlightServer(f"grpc://{host}:0", token=token, capacity=capacity, local=True)
        self.pending: dict[int, list[RolloutBatch]] = {}
        self.received = {"bytes": 0, "messages": 0, "rows": 0}  # taken off the wire since the last `counters()`
        self._local_counted = 0  # the server's same-node batches already reported

    @property
    def location(self) -> str:
        return self.server.location

    @property
    def local_location(self) -> str | None:
        return self.server.local_location

    def count(self, key: int) -> int:
        return sum(len(b) for b in self.pending.get(key, []))

    def take(self, key: int, expected: int, timeout: float, missing: Callable[[int], str]) -> RolloutBatch:
        """All `expected` rows filed under `key`, in row order; `missing(have)` words a timeout."""
        self.fill(key, expected, timeout, missing)
        batches = self.pending.pop(key, [])
        if not batches:  # a rank with no rows of it (fewer validation prompts than trainer ranks)
            return RolloutBatch(pa.RecordBatch.from_pylist([], schema=SCHEMA))
        return RolloutBatch.concat(batches).sorted_by_row()

    def pull(self, timeout: float, missing: Callable[[], str]) -> None:
        """One more batch off the wire, filed by its `step` column."""
        try:
            batch = self.server.get(timeout=timeout)
        except TimeoutError:
            raise TimeoutError(missing()) from None
        self.received["bytes"] += batch.record_batch.nbytes
        self.received["messages"] += 1
        self.received["rows"] += len(batch)
        self.pending.setdefault(int(batch.column("step")[0].as_py()), []).append(batch)

    def fill(self, key: int, expected: int, timeout: float, missing: Callable[[int], str]) -> None:
        """Wait until `key` has all its rows, keeping them filed (a checkpoint about to save them)."""
        while self.count(key) < expected:
            self.pull(timeout, lambda: missing(self.count(key)))

    def counters(self) -> dict[str, int]:
        """Bytes, batches and rows received since the last call (this rank's intake in a step);
        `local_messages`: how many batches came over the same-node socket rather than Flight."""
        out = dict(self.received)
        self.received = dict.fromkeys(out, 0)
        local = int(self.server.stats().get("local_batches", 0))
        out["local_messages"], self._local_counted = local - self._local_counted, local
        return out

    def restore(self, batch: RolloutBatch, mine: Callable[[RolloutBatch], np.ndarray]) -> None:
        """Checkpointed rollouts of later steps: keep the rows `mine` selects, filed by step."""
        batch = batch.take(np.nonzero(mine(batch))[0])
        steps = batch.column("step").to_numpy()
        for step in sorted(set(steps.tolist())):
            self.pending[int(step)] = [batch.take(np.nonzero(steps == step)[0])]

    def shutdown(self) -> None:
        self.server.shutdown()


class RolloutRouter:
    """A rollout rank's clients, one per trainer rank; each batch is split by owner.

    `local_locations[r]`: trainer rank r's same-node socket; a client on that node uses it.

    Why the parts go out at once (a few sender threads, `MAX_SENDERS`) rather than one owner
    after the other: a put returns when its trainer rank has buffered the part, so one at a
    time a rollout rank paid W round trips per batch, and a rank whose buffer was full held
    up every later rank's rows (head-of-line blocking). Each client still sends its own
    parts in order, one put at a time, so numbering and dedup are unchanged.
    """

    MAX_SENDERS = 16  # threads per rollout rank; a put mostly waits on its trainer

    def __init__(self, locations: list[str], token: str, producer_id: str,
                 local_locations: list[str | None] | None = None) -> None:
        from verl_hpc.transport.rollouts import RolloutFlightClient

        local_locations = local_locations or [None] * len(locations)
        self.clients: list[RolloutSender] = [RolloutFlightClient(loc, token=token, producer_id=producer_id, local_location=local)
                        for loc, local in zip(locations, local_locations, strict=True)]
        self._senders: ThreadPoolExecutor | None = None

    def put(self, batch: RolloutBatch, owners: np.ndarray) -> int:
        """Each trainer rank its rows of `batch` (`owners[i]`: row i's rank); returns the bytes sent.

        Returns once every part is buffered by its rank; if any put failed, raises the first
        failure (in rank order) after the others have finished.
        """
        parts = [(int(rank), batch.take(np.nonzero(owners == rank)[0])) for rank in np.unique(owners).tolist()]
        if len(parts) == 1:
            self.clients[parts[0][0]].put(parts[0][1])
        else:
            if self._senders is None:
                self._senders = ThreadPoolExecutor(min(self.MAX_SENDERS, len(self.clients)),
                                                   thread_name_prefix="rollout-router")
            futures = [self._senders.submit(self.clients[rank].put, part) for rank, part in parts]
            wait(futures)
            for future in futures:
                future.result()
        return sum(part.record_batch.nbytes for _, part in parts)

    def close(self) -> None:
        if self._senders is not None:
            self._senders.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()


def positions(batch: RolloutBatch, group_size: int) -> np.ndarray:
    """Each row's place in its step (`group_id * n + sample_index`, data/layout.py)."""
    return batch.column("group_id").to_numpy() * group_size + batch.column("sample_index").to_numpy()
