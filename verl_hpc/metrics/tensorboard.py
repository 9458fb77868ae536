"""Metrics sinks: TensorBoard event files plus a JSONL file any tool can read.

Why both: TensorBoard is what people look at; the JSONL twin (one line per step, written
by the same call) is what tests, benchmarks and resume-equality checks compare
without parsing protobufs. Metric names follow verl's (`actor/pg_loss`, ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, log_dir: str | Path, tensorboard: bool = True, purge_step: int | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if purge_step is not None:
            truncate_jsonl(self.log_dir / "metrics.jsonl", purge_step)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events at/after it: a resumed run never shows a step twice.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if self._writer is not None:
            for name, value in clean.items():
                self._writer.add_scalar(name, value, global_step=step)
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")

    def log_text(self, step: int, tag: str, text: str) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        self._jsonl.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._jsonl.close()


def truncate_jsonl(path: Path, purge_step: int) -> None:
    """Drop lines at or after `purge_step` (a resumed run rewrites those steps), atomically.

    A line that does not parse is a torn write (the disk filled, or the process died mid-line);
    it is dropped too: its step is at or after the checkpoint, so the resumed run writes it again.
    """
    if not path.exists():
        return
    kept = [line if line.endswith("\n") else line + "\n" for line in path.read_text().splitlines(keepends=True)
            if (row := _parse(line)) is not None and row["step"] < purge_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def read_jsonl_metrics(path: str | Path) -> list[dict[str, float]]:
    """Every complete row; a torn last line (a run that died mid-write) is skipped."""
    with open(path) as f:
        return [row for line in f if (row := _parse(line)) is not None]


def _parse(line: str) -> dict | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and "step" in row else None
