"""`verl-hpc plan CONFIG [overrides]`: the memory plan and its estimate, printed without training.

The model's shape is all the plan needs: the quickstart's tiny model is read from its
`init_preset` before it is ever built, so nothing is written and no process is started. The
plan that must fit runs as a fresh command: a plan counts what its process already holds, and
a test process holds whatever earlier tests loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.cli.main import main

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
TIGHT = ["model.memory_budget_gb=0.6"]


def test_plan_prints_each_role_and_what_it_switched_on(tmp_path: Path) -> None:
    model = tmp_path / "not-built"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "verl_hpc", "plan", QUICKSTART, f"model.path={model}", *TIGHT,
                           "model.remove_padding=false"], cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("memory plan, trainer (1 process) on cpu: estimated peak")
    assert "0.60 GiB from model.memory_budget_gb" in lines[0] and ": fits;" in lines[0]
    actor = next(line for line in lines if line.startswith("  actor:"))
    assert "gradient_checkpointing=true (auto:" in actor
    assert "remove_padding=false (set in the config)" in actor  # written by the user, kept
    assert any(line.startswith("  rollout: hf_shared engine") for line in lines)
    assert not model.exists() and list(tmp_path.iterdir()) == []  # nothing built, no run directory


def test_plan_off_prints_the_estimate_of_the_switches_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", QUICKSTART, "model.path=/nonexistent/tiny", "model.memory_plan=off", *TIGHT]) == 0
    out = capsys.readouterr().out
    assert "(model.memory_plan: off, the switches as configured)" in out
    assert "DOES NOT FIT" in out  # the same step the plan above fits, as configured
    assert "(auto:" not in out


def test_plan_without_a_model_shape_names_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", QUICKSTART, "model.path=/nonexistent/model", "model.init_preset=null"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verl-hpc: error: ") and "model.path" in err and "config.json" in err
