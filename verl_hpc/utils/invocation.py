"""The `verl-hpc` command as the user can type it again: for the resume and follow-up lines we print.

Why not always `verl-hpc`: that name works only where the virtual environment's `bin/` is on
PATH, which `.venv/bin/verl-hpc train ...` and `.venv/bin/python -m verl_hpc train ...` (the
README's commands, run without activating anything) do not need. A printed command that
is "not found" as typed is worse than none, so it is derived from how this process was
started: the bare name only when PATH finds this same script.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SCRIPT = "verl-hpc"
MODULES = ("verl_hpc", "verl_hpc.cli.main", "verl_hpc.__main__")
VALUED_OPTIONS = ("-X", "-W", "--check-hash-based-pycs")  # interpreter options that take the next word


def cli_command(orig_argv: Sequence[str] | None = None,
                which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """`["verl-hpc"]`, `[".venv/bin/verl-hpc"]` or `[PYTHON, "-m", "verl_hpc"]`, as this process was started.

    `orig_argv` defaults to `sys.orig_argv` (the interpreter's own argv: `python -m verl_hpc`
    keeps the interpreter as typed; a console script shows as `[python, SCRIPT, ...]`, SCRIPT
    as the shell found it: as typed, or its full path when PATH found it).
    """
    args = list(sys.orig_argv if orig_argv is None else orig_argv)
    index = 1
    while index < len(args) and args[index].startswith("-"):  # the interpreter's own options
        if args[index] == "-m":
            if index + 1 < len(args) and args[index + 1] in MODULES:
                return _shortest([args[0], "-m", "verl_hpc"], which, None)
            break
        index += 2 if args[index] in VALUED_OPTIONS else 1
    script = next((a for a in args[:2] if Path(a).name == SCRIPT), None)
    if script is None:
        return [SCRIPT]  # not started as the CLI (a test calling main(), a notebook): the documented name
    return _shortest([script], which, script)


def _shortest(command: list[str], which: Callable[[str], str | None], script: str | None) -> list[str]:
    """The bare `verl-hpc` when PATH finds the same environment's script, else `command` as typed."""
    found = which(SCRIPT)
    if found is None:
        return command
    here = Path(script).resolve() if script is not None and os.sep in script else \
        Path(sys.executable).parent.resolve() / SCRIPT  # the venv's python is a link: keep its folder
    return [SCRIPT] if script == SCRIPT or Path(found).resolve() == here else command


def command_line(*args: str, orig_argv: Sequence[str] | None = None) -> str:
    """`verl-hpc ARGS...` (as this process was started), quoted for a POSIX shell."""
    import shlex

    return shlex.join([*cli_command(orig_argv), *args])


def python_command(orig_argv: Sequence[str] | None = None) -> str:
    """The interpreter to print before a repository script: as typed when it was typed, else this one."""
    args = list(sys.orig_argv if orig_argv is None else orig_argv)
    typed = args[0] if args else ""
    return typed if Path(typed).name.startswith("python") else sys.executable
