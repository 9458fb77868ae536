"""Structured logs per role and rank under the run directory.

Why JSON lines in files and short text on the console: a 64-node job's logs are read by
tools (grep, jq) after the fact, but a person watching a terminal wants one line.
Every record carries role and rank, so merged logs still say who spoke.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

LOGGER_NAME = "verl_hpc"


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str, rank: int):
        super().__init__()
        self.role, self.rank = role, rank

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                 "level": record.levelname.lower(), "role": self.role, "rank": self.rank,
                 "logger": record.name, "msg": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at emit time, not the object it was at set-up.

    Why: a handler bound to the stderr of its day writes into a closed stream once that
    stream is swapped (a test's capture, a daemonised worker) and every later record becomes
    a logging error on the terminal.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - logging's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def setup_logging(log_dir: str | Path | None, role: str = "trainer", rank: int = 0,
                  level: str = "info", console: bool = True) -> logging.Logger:
    """(Re)configure the package logger: a JSONL file per role/rank, plus plain console lines."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level.upper())
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = False
    if log_dir is not None:
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path / f"{role}_rank{rank}.log", encoding="utf-8")
        file_handler.setFormatter(JsonFormatter(role, rank))
        logger.addHandler(file_handler)
    if console:
        stream = _CurrentStderr()
        stream.setFormatter(logging.Formatter(f"[%(levelname)s {role}:{rank}] %(message)s"))
        stream.setLevel(max(logger.level, logging.INFO))
        logger.addHandler(stream)
    return logger


def get_logger(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)
