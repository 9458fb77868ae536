"""Metrics: the last layer; sinks (TensorBoard, JSONL, Prometheus, wandb, MLflow), progress, gauges."""

from verl_hpc.metrics.factory import open_sinks
from verl_hpc.metrics.memory import memory_metrics
from verl_hpc.metrics.progress import Progress
from verl_hpc.metrics.sink import Emitter, MetricSinks
from verl_hpc.metrics.tensorboard import read_jsonl_metrics

__all__ = ["Emitter", "MetricSinks", "Progress", "memory_metrics", "open_sinks", "read_jsonl_metrics"]
