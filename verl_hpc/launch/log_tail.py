"""What the launcher shows of a failed worker's log: the lines that say why it failed."""

from __future__ import annotations

import os
from pathlib import Path

TAIL_LINES = 20
_TAIL_BYTES = 64 * 1024


def read_tail(path: Path, start: int = 0, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` lines written at or after byte `start` (this attempt's output only)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(start, size - _TAIL_BYTES))
            data = fh.read()
    except OSError:
        return []
    return crash_excerpt(data.decode("utf-8", errors="replace").splitlines(), lines)


FATAL_HEADER = "Fatal Python error:"


def crash_excerpt(log_lines: list[str], lines: int = TAIL_LINES) -> list[str]:
    """What a reader needs from a log: its last `lines` lines, or, after a native crash, its cause.

    Why: faulthandler dumps every thread's stack after a SIGSEGV or SIGABRT, so the tail
    of the log is just the oldest thread's frames. The cause is elsewhere: the C++
    runtime's own lines (`terminate called after throwing ... what(): ...`) just above the
    header, the header, then the crashing thread ("Current thread"; a crash in a thread
    without Python frames has none, and the main thread, dumped last, stands in).
    """
    header = next((i for i in range(len(log_lines) - 1, -1, -1) if log_lines[i].startswith(FATAL_HEADER)), None)
    if header is None:
        return log_lines[-lines:]
    blocks: list[list[str]] = []
    for line in log_lines[header + 1:]:
        if line.startswith(("Current thread", "Thread 0x")):
            blocks.append([])
        if blocks and line.strip():
            blocks[-1].append(line)
    crashed = next((b for b in blocks if b[0].startswith("Current thread")), blocks[-1] if blocks else [])
    context = [line for line in log_lines[max(0, header - 3):header] if line.strip()]
    return (context + [log_lines[header]] + crashed)[:lines]
