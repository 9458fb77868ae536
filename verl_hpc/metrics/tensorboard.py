"""The default sinks: TensorBoard event files plus a JSONL file any tool can read.

Why both: TensorBoard is what people look at; the JSONL twin (one line per step, written
by the same call) is what tests, benchmarks, resume-equality checks and `verl-hpc report`
read without parsing protobufs. Metric names follow verl's (`actor/pg_loss`, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


class TensorBoardSink:
    """Event files under the log dir; `purge_step` drops events at/after it, so a resumed run
    never shows a step twice."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def log_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class JsonlSink:
    """`metrics.jsonl`: one line per step; a resumed run first drops the lines it will rewrite."""

    name = "jsonl"

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        path = Path(log_dir) / "metrics.jsonl"
        if purge_step is not None:
            truncate_jsonl(path, purge_step)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the run's life

    def log_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Text (sample tables) goes to TensorBoard only: a JSONL row is one step's numbers."""

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
