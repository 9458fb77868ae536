"""The one interface every metric destination implements, and the container the runtime calls.

Why a container that swallows a sink's failure: TensorBoard, JSONL, Prometheus, wandb and
MLflow are views of the run, not the run. A full disk under wandb's directory or a
Pushgateway that went away must cost a warning, once, and never the hours of training
behind it (torchtitan's logger container has the same shape). JSONL is the exception the
run itself reads back (resume, `verl-hpc report`), so it is opened first and its failure
to open is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger("verl_hpc.metrics")


@dataclass(frozen=True)
class Emitter:
    """Who speaks: the labels every sink attaches (Prometheus labels, wandb/MLflow run names)."""

    run_dir: Path
    run_name: str
    role: str          # trainer, rollout, ref, critic, reward
    rank: int          # global rank of the process
    job_id: str = "local"

    @property
    def tag(self) -> str:
        return f"{self.role}_rank{self.rank}"

    @property
    def key(self) -> str:
        """12 hex characters of sha256(resolved run dir + tag): the same for every attempt of this
        process's part of the run, different for every other; wandb's run id, MLflow's lookup tag."""
        text = f"{Path(self.run_dir).resolve()}\0{self.tag}".encode()
        return hashlib.sha256(text).hexdigest()[:12]

    @staticmethod
    def job_of_env() -> str:
        return os.environ.get("SLURM_JOB_ID") or "local"


class MetricSink(Protocol):
    name: str

    def log_scalars(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_text(self, step: int, tag: str, text: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def finite(metrics: Mapping[str, float | None]) -> dict[str, float]:
    """The values a sink can store: numbers, finite (a NaN loss is the step's news, not a datum)."""
    out = {}
    for key, value in metrics.items():
        if value is None:
            continue
        number = float(value)
        if math.isfinite(number):
            out[key] = number
    return out


class MetricSinks:
    """Every open sink; a sink that raises is reported once and dropped, the others go on."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = list(sinks)
        self.failed: dict[str, str] = {}

    def names(self) -> list[str]:
        return [s.name for s in self.sinks]

    def log_scalars(self, step: int, metrics: Mapping[str, float | None]) -> None:
        clean = finite(metrics)
        self._each("log_scalars", step, clean)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self._each("log_text", step, tag, text)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
        self.sinks = []

    def _each(self, method: str, *args: object) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # noqa: BLE001 - a view of the run must never stop it
                self.drop(sink, f"{method} failed: {type(err).__name__}: {err}")

    def drop(self, sink: MetricSink, why: str) -> None:
        self.sinks.remove(sink)
        self.failed[sink.name] = why
        log.warning("metrics sink %s disabled for the rest of the run: %s", sink.name, why)
        with contextlib.suppress(Exception):  # already broken: its close may fail the same way
            sink.close()
