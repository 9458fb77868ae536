"""The launcher's terminal during a multi-process run: a start-up line per role,
trainer rank 0's progress and INFO lines as they come, WARNING/ERROR lines of every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launch.test_launch_local import split_plan
from verl_hpc.launch.local import LocalLauncher

WORKER = '''
import os, sys
group, rank = os.environ["VERL_HPC_GROUP"], os.environ["VERL_HPC_RANK"]
print(f"[INFO {group}:{rank}] hello from {group} {rank}", file=sys.stderr, flush=True)
print(f"[train] step 1/2 (0s) score=0.5 rank={rank}", file=sys.stderr, flush=True)
print("plain output stays in the file", flush=True)
print(f"[WARNING {group}:{rank}] careful", file=sys.stderr, end="")  # unterminated: the final pump prints it
'''


@pytest.fixture
def quiet_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's own log lines (whatever console an earlier test set up) are not the relay's."""
    import logging

    monkeypatch.setattr(logging.getLogger("verl_hpc"), "handlers", [logging.NullHandler()])


def test_terminal_shows_startup_progress_and_trouble(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     quiet_launcher: None) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    plan = split_plan()
    assert LocalLauncher(plan, tmp_path / "run", [sys.executable, str(script)]).run() == 0
    lines = capsys.readouterr().err.splitlines()
    starts = [line for line in lines if line.startswith("[launch] ")]
    assert [s.split(":")[0] for s in starts] == [f"[launch] {g.name}" for g in plan.groups]
    assert "ranks 0, 1 started" in starts[0]
    relayed = [line for line in lines if not line.startswith("[launch] ")]
    leader = plan.groups[0].name
    expected = [f"[INFO {leader}:0] hello from {leader} 0", "[train] step 1/2 (0s) score=0.5 rank=0"]
    expected += [f"[WARNING {plan.locate(r)[0].name}:{r}] careful" for r in range(plan.world_size)]
    assert sorted(relayed) == sorted(expected)  # other ranks' INFO and progress lines stay in their files
    assert not any("plain output" in line for line in lines)


def test_relay_off_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    assert LocalLauncher(split_plan(), tmp_path / "run", [sys.executable, str(script)], relay=False).run() == 0
    assert "[train]" not in capsys.readouterr().err
