"""The command a resume or stop message prints works as the user typed theirs.

Pure: `cli_command` takes the interpreter's argv and a PATH lookup, so every way of starting
the CLI is one line here (the real start, `python -m verl_hpc` with this venv off PATH, runs in
tests/launch/test_executor.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_hpc.utils.invocation import cli_command, command_line, python_command

VENV_SCRIPT = str(Path(sys.executable).parent / "verl-hpc")


def nowhere(_: str) -> None:
    return None


@pytest.mark.parametrize(("argv", "which", "expected"), [
    # the README's way, venv not activated: as typed
    ([sys.executable, ".venv/bin/verl-hpc", "train", "c.yaml"], nowhere, [".venv/bin/verl-hpc"]),
    ([".venv/bin/python", "-m", "verl_hpc", "train"], nowhere, [".venv/bin/python", "-m", "verl_hpc"]),
    (["python3", "-X", "dev", "-m", "verl_hpc", "train"], nowhere, ["python3", "-m", "verl_hpc"]),
    # venv activated: PATH finds this very script, so the short name works
    ([sys.executable, VENV_SCRIPT, "train"], lambda _: VENV_SCRIPT, ["verl-hpc"]),
    ([".venv/bin/python", "-m", "verl_hpc"], lambda _: VENV_SCRIPT, ["verl-hpc"]),
    # PATH finds another installation's script: this one, as typed
    ([sys.executable, VENV_SCRIPT, "train"], lambda _: "/opt/other/bin/verl-hpc", [VENV_SCRIPT]),
    # not the CLI at all (a test calling main(), a notebook): the documented name
    (["pytest", "-q"], nowhere, ["verl-hpc"]),
    (["python", "-m", "pytest"], nowhere, ["verl-hpc"]),
])
def test_the_command_is_the_one_the_user_started(argv: list[str], which, expected: list[str]) -> None:
    assert cli_command(argv, which) == expected


def test_command_line_quotes_for_a_shell() -> None:
    line = command_line("train", "my config.yaml", "--run-dir", "runs/a b",
                        orig_argv=[".venv/bin/python", "-m", "verl_hpc"])
    assert line.startswith(".venv/bin/python -m verl_hpc train 'my config.yaml' --run-dir 'runs/a b'") \
        or line.startswith("verl-hpc train")  # when this venv is on PATH


def test_python_command_is_the_typed_interpreter() -> None:
    assert python_command([".venv/bin/python", "-m", "verl_hpc"]) == ".venv/bin/python"
    assert python_command(["pytest"]) == sys.executable
