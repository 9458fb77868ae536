"""What the launcher's terminal shows while the workers run: start-up, progress, trouble.

Why: every worker writes to its own `logs/<group>_rank<N>.out`, so a multi-process run
was silent on the terminal until it ended. The relay copies, as they appear, trainer
rank 0's progress lines (`[train] step ...`) and its INFO lines (training started,
"resumed from ... at step N", checkpoints, done), plus WARNING/ERROR lines of any rank,
so the terminal reads like the one-process path's. Everything else stays in the files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, TextIO

_LEADER = re.compile(r"^\[(train\]|(INFO|WARNING|ERROR|CRITICAL) )")
_ANY = re.compile(r"^\[(WARNING|ERROR|CRITICAL) ")


class LogRelay:
    """Tails the workers' log files from this attempt's offsets; `pump()` prints complete new lines."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self._files: list[tuple[Path, bool]] = []  # (path, is the leader)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def watch(self, path: Path, offset: int, leader: bool) -> None:
        self._files.append((path, leader))
        self._offsets[path], self._partial[path] = offset, b""

    def say(self, text: str) -> None:
        stream = self.stream or sys.stderr
        print(text, file=stream, flush=True)

    def pump(self, final: bool = False) -> None:
        """Print the watched lines written since the last call (a last unterminated one when final)."""
        for path, leader in self._files:
            data = self._read(path)
            lines = (self._partial[path] + data).split(b"\n")
            self._partial[path] = b"" if final else lines.pop()
            pattern = _LEADER if leader else _ANY
            for raw in lines:
                line = raw.decode("utf-8", errors="replace").rstrip("\r")
                if line and pattern.match(line):
                    self.say(line)

    def _read(self, path: Path) -> bytes:
        try:
            with open(path, "rb") as fh:
                fh.seek(self._offsets[path])
                data = fh.read()
        except OSError:
            return b""
        self._offsets[path] += len(data)
        return data


def announce(relay: LogRelay, workers: list[Any]) -> None:
    """One start-up line per role; trainer rank 0 (else the first rank) is relayed in full from now on.

    `workers` are the launcher's records: `.group`, `.rank`, `.popen.pid`, `.log_path`, `.log_offset`.
    """
    by_group: dict[str, list[Any]] = {}
    for worker in workers:
        by_group.setdefault(worker.group, []).append(worker)
    leader = next((w for w in workers if w.group == "trainer"), workers[0] if workers else None)
    for group, members in by_group.items():
        ranks = ", ".join(str(w.rank) for w in members)
        pids = ", ".join(str(w.popen.pid) for w in members)
        relay.say(f"[launch] {group}: rank{'s' if len(members) > 1 else ''} {ranks} started (pid {pids}), "
                  f"log {members[0].log_path}")
        for worker in members:
            relay.watch(worker.log_path, worker.log_offset, worker is leader)
