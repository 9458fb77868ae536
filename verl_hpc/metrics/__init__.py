"""Metrics: the last layer; TensorBoard + JSONL sinks, progress display, memory gauges."""

from verl_hpc.metrics.memory import memory_metrics
from verl_hpc.metrics.progress import Progress
from verl_hpc.metrics.tensorboard import MetricsLogger, read_jsonl_metrics

__all__ = ["MetricsLogger", "Progress", "memory_metrics", "read_jsonl_metrics"]
