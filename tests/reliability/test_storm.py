"""A CI-sized preemption storm (tools/storm.py): runs hit by SIGUSR1/SIGTERM/SIGKILL at random
moments, restarted until done, must reproduce the uninterrupted run's metrics step for step.
The full storm (N >= 20) and its figures are in docs/reliability.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def load_storm():
    """tools/ is not a package: import the driver from its file (registered, for its dataclasses)."""
    if "storm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("storm", REPO / "tools" / "storm.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["storm"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["storm"]


def test_small_storm_finishes_every_run_with_identical_metrics(tmp_path: Path, tiny_model_dir: Path) -> None:
    storm = load_storm()
    summary = storm.main(["--runs", "2", "--layouts", "embedded,split", "--hits", "2", "--steps", "6",
                          "--interval", "2", "--seed", "7", "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    assert summary["runs"] == 2 and summary["finished"] == 2, summary
    assert summary["mismatches"] == 0, summary
    assert summary["hung"] == 0 and summary["orphans"] == 0, summary
    assert summary["interruptions"] >= 2, summary
    assert (tmp_path / "storm.json").is_file()


def test_compare_names_the_step_and_metric() -> None:
    storm = load_storm()
    whole = [{"step": 1, "a": 1.0, "timing_s/x": 3.0}, {"step": 2, "a": 2.0}]
    assert storm.compare(whole, [{"step": 1, "a": 1.0, "timing_s/x": 9.0}, {"step": 2, "a": 2.0}]) == []
    assert storm.compare(whole, [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.5}]) == ["step 2 a: 2.5 != 2.0"]
    assert storm.compare(whole, [{"step": 2, "a": 2.0}])[0].startswith("steps [2] != [1, 2]")
