"""Memory gauges under `memory/`: peak host RSS always, device memory when on a GPU."""

from __future__ import annotations

import resource
import sys

import torch


def memory_metrics(device: torch.device) -> dict[str, float]:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak_kb if sys.platform == "darwin" else peak_kb * 1024
    out = {"memory/peak_rss_gb": peak_bytes / 2**30}
    if device.type == "cuda" and torch.cuda.is_available():
        out["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["memory/max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out
