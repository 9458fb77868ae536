"""Where verl 0.9.1 lives for the parity tests, and how to run code next to it.

tools/verl_ref.sh installs it (tools/test.sh runs that first); a test run alone installs
it here on first use. Only when the install itself fails (no network to PyPI, no space)
do the tests skip, with pip's last line as the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 600
_found: dict[str, Path | str] = {}


def verl_reference_dir() -> Path:
    """The folder holding verl 0.9.1 and its import-time needs; skips the test if it cannot exist."""
    if "dir" not in _found:
        result = subprocess.run(["bash", str(REPO / "tools" / "verl_ref.sh")], cwd=REPO, capture_output=True,
                                text=True, timeout=INSTALL_TIMEOUT_S)
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        if result.returncode == 0 and lines and Path(lines[-1]).is_dir():
            _found["dir"] = Path(lines[-1])
        else:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            _found["dir"] = f"verl 0.9.1 could not be installed from PyPI by tools/verl_ref.sh: {last}"
    found = _found["dir"]
    if isinstance(found, str):
        pytest.skip(found)
    return found


def run_beside_verl(args: list[str], with_project: bool = False) -> subprocess.CompletedProcess:
    """`python ARGS` with verl on PYTHONPATH (after this checkout when `with_project`: the reference
    folder holds a stray top-level `tests` package of one of verl's needs, which must not shadow ours)."""
    paths = ([str(REPO)] if with_project else []) + [str(verl_reference_dir())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false",
           "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{args} beside verl failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def verl_numbers(cases: dict[str, dict[str, Any]], tmp_path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """verl's outputs for `cases` (tests/algo/verl_reference.py), computed in a process of its own."""
    source, answer = tmp_path / "cases.pt", tmp_path / "verl.pt"
    torch.save(cases, source)
    run_beside_verl([str(REPO / "tests" / "algo" / "verl_reference.py"), str(source), str(answer)])
    return torch.load(answer, weights_only=False)
