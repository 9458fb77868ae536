"""Progress for humans: a bar on a terminal, periodic plain lines in Slurm logs and pipes."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, initial: int = 0, mode: str = "auto", every_seconds: float = 10.0,
                 stream: TextIO | None = None, desc: str = "train"):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode, self.total, self.step, self.desc = mode, total, initial, desc
        self.every_seconds = every_seconds
        self._last_line = 0.0
        self._start = time.monotonic()
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True)

    def update(self, step: int, summary: dict[str, float]) -> None:
        shown = {k.split("/")[-2] + "/" + k.split("/")[-1] if k.count("/") > 1 else k: v
                 for k, v in summary.items()}
        self.step = step
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last_line >= self.every_seconds or step >= self.total:
                self._last_line = now
                text = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
                elapsed = now - self._start
                print(f"[{self.desc}] step {step}/{self.total} ({elapsed:.0f}s) {text}", file=self.stream,
                      flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
