"""The package logger: JSON lines per role/rank in files, one plain line on the console."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from verl_hpc.utils.logging import get_logger, setup_logging


def test_file_lines_are_json_with_role_and_rank(tmp_path: Path) -> None:
    setup_logging(tmp_path, role="critic", rank=3, console=False)
    get_logger("test").info("hello", extra={"fields": {"step": 7}})
    entry = json.loads((tmp_path / "critic_rank3.log").read_text().splitlines()[-1])
    assert (entry["role"], entry["rank"], entry["msg"], entry["step"]) == ("critic", 3, "hello", 7)


def test_console_follows_a_replaced_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stderr closed after set-up (a finished capture) must not turn records into logging errors."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging(None, role="trainer", rank=0)
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    get_logger("test").info("after the swap")
    assert second.getvalue() == "[INFO trainer:0] after the swap\n"
    setup_logging(None, console=False)
