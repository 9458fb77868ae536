"""The README answers a new user's first questions: every command, and what the tests cost.

Why a test: commands added to the CLI (`resubmit`, `sbatch --prepare`) went unlisted, and a
fresh-clone user could not tell that the test command runs for over an hour and fills gigabytes.
Whatever the README's commands write into the clone (runs, datasets) must not show up in git.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO
from verl_hpc.cli.main import build_parser

README = REPO / "README.md"


def section(title: str) -> str:
    """The README's text from the heading `## title` to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def top_level_commands() -> list[str]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return sorted(subparsers.choices)


def test_the_commands_table_lists_every_command_and_its_switches() -> None:
    table = section("Commands")
    listed = {m.group(1) for m in re.finditer(r"`(?:verl-hpc )?([a-z][a-z-]*)[ `]", table)}
    assert not set(top_level_commands()) - listed, "commands missing from the README's table"
    for switch in ("--prepare", "--dry-run", "--allow-config-change"):
        assert switch in table, switch


def test_the_test_command_states_its_duration_and_disk_use() -> None:
    setup = section("Set up and run")
    assert "bash tools/test.sh" in setup
    about_tests = [p for p in setup.split("\n\n") if "`tools/test.sh`" in p]
    assert any(re.search(r"\d+ minutes", p) and re.search(r"\d+ GB under `/tmp`", p) for p in about_tests), \
        "say how long `bash tools/test.sh` takes and what it leaves on disk"
    assert "TMPDIR" in setup and "docs/testing.md" in setup


@pytest.mark.parametrize("path", ["runs/quickstart/config.yaml", "data/gsm8k/train.parquet"])
def test_what_the_readmes_commands_write_is_ignored_by_git(path: str) -> None:
    if shutil.which("git") and (REPO / ".git").exists():
        result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, timeout=30)
        assert result.returncode == 0, f"{path} would show up in `git status`"
    else:  # an unpacked archive: the ignore file itself
        ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
        assert f"/{path.split('/')[0]}/" in ignored
