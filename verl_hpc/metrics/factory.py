"""Open the sinks a config names for one emitting process.

Why construction is guarded too: an optional sink that cannot start (wandb's directory is
read-only, the MLflow store is unreachable, the `/metrics` port is taken) is reported in
one warning and left out; the run goes on with the others. JSONL alone must open: the
run reads it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from verl_hpc.metrics.history import RunSummary
from verl_hpc.metrics.sink import Emitter, MetricSink, MetricSinks
from verl_hpc.metrics.tensorboard import JsonlSink, TensorBoardSink

if TYPE_CHECKING:
    from verl_hpc.config.observability import LoggingConfig

log = logging.getLogger("verl_hpc.metrics")


def open_sinks(cfg: LoggingConfig, emitter: Emitter, log_dir: Path, purge_step: int | None = None,
               summary: RunSummary | None = None) -> MetricSinks:
    """`log_dir` holds TensorBoard's events and metrics.jsonl; the others go where their config says."""
    log_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = [JsonlSink(log_dir, purge_step)]
    failed: dict[str, str] = {}
    for name in cfg.active_sinks():
        if name == "jsonl":
            continue
        try:
            sinks.append(_open(name, cfg, emitter, log_dir, purge_step, summary))
        except Exception as err:  # noqa: BLE001 - an optional view of the run
            failed[name] = f"{type(err).__name__}: {err}"
            log.warning("metrics sink %s could not start and is left out: %s", name, failed[name])
    out = MetricSinks(sinks)
    out.failed.update(failed)
    return out


SinkOpener = Callable[["LoggingConfig", Emitter, Path, "int | None", "RunSummary | None"], MetricSink]
SINKS: dict[str, SinkOpener] = {}  # logging.sinks name -> opener (jsonl is always open)


def register_sink(name: str) -> Callable[[SinkOpener], SinkOpener]:
    def add(opener: SinkOpener) -> SinkOpener:
        SINKS[name] = opener
        return opener
    return add


def _open(name: str, cfg: LoggingConfig, emitter: Emitter, log_dir: Path, purge_step: int | None,
          summary: RunSummary | None) -> MetricSink:
    if name not in SINKS:
        raise ValueError(f"unknown sink {name!r}")
    return SINKS[name](cfg, emitter, log_dir, purge_step, summary)


@register_sink("tensorboard")
def _tensorboard(cfg: LoggingConfig, emitter: Emitter, log_dir: Path, purge_step: int | None,
                 summary: RunSummary | None) -> MetricSink:
    return TensorBoardSink(log_dir, purge_step)


@register_sink("prometheus")
def _prometheus(cfg: LoggingConfig, emitter: Emitter, log_dir: Path, purge_step: int | None,
                summary: RunSummary | None) -> MetricSink:
    from verl_hpc.metrics.prometheus import PrometheusSink

    return PrometheusSink(cfg.prometheus, emitter, summary)


@register_sink("wandb")
def _wandb(cfg: LoggingConfig, emitter: Emitter, log_dir: Path, purge_step: int | None,
           summary: RunSummary | None) -> MetricSink:
    from verl_hpc.metrics.wandb_sink import WandbSink

    return WandbSink(cfg.wandb, emitter, purge_step)


@register_sink("mlflow")
def _mlflow(cfg: LoggingConfig, emitter: Emitter, log_dir: Path, purge_step: int | None,
            summary: RunSummary | None) -> MetricSink:
    from verl_hpc.metrics.mlflow_sink import MlflowSink

    return MlflowSink(cfg.mlflow, emitter)
