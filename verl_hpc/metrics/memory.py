"""Memory gauges under `memory/`: host RSS now and at its peak, device memory on a GPU.

Why both host figures: the peak says whether a step fits the node; the current value,
step after step, is the trend that shows a leak (tests/e2e/soak.py fits its slope).
"""

from __future__ import annotations

import resource
import sys

import psutil
import torch


def memory_metrics(device: torch.device) -> dict[str, float]:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak_kb if sys.platform == "darwin" else peak_kb * 1024
    out = {"memory/peak_rss_gb": peak_bytes / 2**30, "memory/rss_gb": psutil.Process().memory_info().rss / 2**30}
    if device.type == "cuda" and torch.cuda.is_available():
        out["memory/allocated_gb"] = torch.cuda.memory_allocated(device) / 2**30
        out["memory/reserved_gb"] = torch.cuda.memory_reserved(device) / 2**30
        out["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["memory/max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out
