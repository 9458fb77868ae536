"""The trainer's bounded rollout buffer and the record of what it already took.

Why apart from the Flight server: the buffer is the part with the delivery contract
(exactly-once into the buffer, blocking puts when full, a cancelled put never enqueued)
and is tested on its own; the servers only read requests and hand batches to it (the
same-node route hands them still encoded, and `get` decodes them: `wire.EncodedBatch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pyarrow.flight as flight

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts.wire import EncodedBatch

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.1  # how often a blocked put re-checks whether its client went away


class SeenSequences:
    """Per-producer set of sequence numbers, compacted below a contiguous watermark.

    Why compacted: producers number their puts 0, 1, 2, ...; remembering only the
    first gap plus the few numbers above it keeps memory flat over a long run.
    """

    def __init__(self) -> None:
        self._low: dict[str, int] = {}
        self._above: dict[str, set[int]] = {}

    def __contains__(self, key: tuple[str, int]) -> bool:
        producer, seq = key
        return seq < self._low.get(producer, 0) or seq in self._above.get(producer, ())

    def add(self, key: tuple[str, int]) -> None:
        producer, seq = key
        low, above = self._low.get(producer, 0), self._above.setdefault(producer, set())
        above.add(seq)
        while low in above:
            above.remove(low)
            low += 1
        self._low[producer] = low


class RolloutBuffer:
    """The bounded, deduplicating FIFO between Flight handler threads and the trainer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._cond = threading.Condition()
        self._queue: deque[RolloutBatch | EncodedBatch] = deque()
        self._seen = SeenSequences()
        self._last_heard: dict[str, float] = {}
        self._closed = False
        self._waiting = 0
        self.counts = {"received": 0, "duplicates": 0, "consumed": 0, "rejected": 0}

    def offer(self, key: tuple[str, int], batch: RolloutBatch | EncodedBatch, cancelled: Callable[[], bool],
              wake: bool = True) -> str:
        """Enqueue unless already seen; block while full. Returns "queued" or "duplicate".

        Why the seen-check sits inside the wait loop: a retry can arrive while the
        original put is still blocked; whichever gets space first enqueues, the other
        then sees the key as seen and is acknowledged as a duplicate. `wake=False`: the
        caller wakes the consumer itself (`wake()`) once it has acknowledged the batch,
        so the acknowledgement does not wait behind the consumer for Python's GIL.
        """
        with self._cond:
            self._last_heard[key[0]] = time.monotonic()
            self._waiting += 1
            try:
                while True:
                    if key in self._seen:
                        self.counts["duplicates"] += 1
                        return "duplicate"
                    if self._closed:
                        raise flight.FlightUnavailableError("rollout server is shutting down")
                    if len(self._queue) < self.capacity:
                        self._queue.append(batch)
                        self._seen.add(key)
                        self.counts["received"] += 1
                        if wake:
                            self._cond.notify_all()
                        return "queued"
                    if cancelled():  # the producer timed out or died; free this handler
                        raise flight.FlightCancelledError("producer went away while the buffer was full")
                    self._cond.wait(_WAIT_SLICE_S)
            finally:
                self._waiting -= 1

    def get(self, timeout: float | None) -> RolloutBatch:
        """The oldest batch, decoded and checked here if it arrived encoded (`wire.EncodedBatch`).

        One that fails the check is dropped, counted under "rejected" and logged, and the
        next one is returned: the trainer goes on as if its producer had been refused.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            item = self._pop(deadline, timeout)
            if not isinstance(item, EncodedBatch):
                return item
            try:
                return item.decode()
            except flight.FlightServerError as exc:
                self.reject()
                log.error("%s; dropped after it was acknowledged as queued", exc)

    def _pop(self, deadline: float | None, timeout: float | None) -> RolloutBatch | EncodedBatch:
        with self._cond:
            while not self._queue:
                if self._closed:
                    raise RuntimeError("rollout server is shut down and its buffer is empty")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no rollout batch arrived within {timeout:.1f} s; "
                                       f"producers heard from so far: {self._describe_producers()}")
                self._cond.wait(remaining)
            item = self._queue.popleft()
            self.counts["consumed"] += 1
            self._cond.notify_all()  # wake producers blocked on a full buffer
            return item

    def _describe_producers(self) -> str:
        now = time.monotonic()
        heard = sorted(self._last_heard.items(), key=lambda kv: kv[0])
        return ", ".join(f"{p} (last {now - t:.1f} s ago)" for p, t in heard) or "none"

    def wake(self) -> None:
        """Tell a waiting consumer that batches may be there (after `offer(..., wake=False)`)."""
        with self._cond:
            self._cond.notify_all()

    def qsize(self) -> int:
        with self._cond:
            return len(self._queue)

    def reject(self) -> None:
        with self._cond:
            self.counts["rejected"] += 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self.counts, "queued": len(self._queue), "capacity": self.capacity,
                    "waiting_puts": self._waiting, "producers": sorted(self._last_heard), "closed": self._closed}
