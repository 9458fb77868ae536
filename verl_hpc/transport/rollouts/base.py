"""The two ends of the rollout transport, as every backend implements them.

Why a base: the trainer side (`intake.TrainerIntake`) and the producer side
(`intake.RolloutRouter`) hold a receiver and senders, never a particular backend. The
contract every backend keeps: a put returns once the receiver has buffered the batch
(back-pressure: it blocks while the receiver is full), a batch is delivered at most once
per (producer, sequence number) even across reconnects, every batch is checked against the
rollout schema before it is accepted, and only a producer presenting the run's secret is
heard. The Arrow Flight backend (flight.py) serves gRPC and, for producers on the
receiver's own node, a Unix socket (local.py) with the same contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from verl_hpc.data.rollout_batch import RolloutBatch


class RolloutSender(ABC):
    """A producer's end, connected to one receiver."""

    @abstractmethod
    def put(self, batch: RolloutBatch) -> None:
        """Deliver `batch`; returns once the receiver has buffered it."""

    @abstractmethod
    def close(self) -> None: ...


class RolloutReceiver(ABC):
    """A trainer rank's end: the batches every producer put, in arrival order."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where senders connect."""

    @abstractmethod
    def get(self, timeout: float | None = None) -> RolloutBatch:
        """The next batch (raises `queue.Empty` after `timeout` seconds without one)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """What it has received and refused so far."""

    @abstractmethod
    def shutdown(self) -> None: ...
