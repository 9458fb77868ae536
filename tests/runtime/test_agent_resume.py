"""Agent episodes survive kill -9: a split multi-turn run killed mid-run resumes to the same numbers.

The rollout rank runs its episodes one step ahead (`max_staleness: 1`), so at a checkpoint the
trainer holds finished episodes it has not trained on yet; they ride in the checkpoint as
trajectory rows and are trained on after the resume, none lost and none run twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli
from tests.e2e.test_train_e2e import scalars
from tests.runtime.test_resume import VOLATILE, _steps

pytestmark = pytest.mark.slow
STEPS = 8


def write_config(tmp_path: Path, model_dir: Path) -> Path:
    cfg = {"model": {"path": str(model_dir), "init_preset": "tiny-agent"},
           "data": {"task": {"name": "hidden_digit", "num_prompts": 64, "max_operand": 3, "seed": 0}},
           "reward": {"function": "verl_hpc.data.tasks.hidden_digit:score"},
           "rollout": {"multi_turn": {"enable": True, "tools": ["verl_hpc.data.tasks.hidden_digit:peek"],
                                      "max_assistant_turns": 2, "max_tool_response_length": 16,
                                      # a round waits for every reply: the same episodes whatever the latency
                                      "deterministic_rounds": True}},
           "algorithm": {"name": "grpo", "sampling": {"n": 4, "max_new_tokens": 6}, "kl": {"coef": 0.0},
                         "max_staleness": 1},
           "trainer": {"total_steps": STEPS, "batch_size": 16, "seed": 0, "torch_threads": 1,
                       "actor_optim": {"lr": 3e-3}},
           "resources": {"actor": {"device_ids": [0]}, "rollout": {"device_ids": [1]}, "placement": "split",
                         "timeout_seconds": 120},
           "checkpoint": {"interval_steps": 3}, "logging": {"progress": "off"}}
    path = tmp_path / "agent_split.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_sigkill_mid_run_then_resume_loses_no_episode(tmp_path: Path) -> None:
    from verl_hpc.models.tiny import init_model

    model_dir = init_model(tmp_path / "tiny-agent", preset="tiny-agent", seed=0)
    config = write_config(tmp_path, model_dir)
    whole = tmp_path / "whole"
    proc = run_cli("train", str(config), "--run-dir", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]
    interrupted = tmp_path / "interrupted"
    cli = subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", str(config), "--run-dir", str(interrupted),
                            "trainer.total_steps=400"], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    marker = interrupted / "checkpoints" / "step_00000006" / "manifest.json"
    deadline = time.monotonic() + 600
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(cli.pid, signal.SIGKILL)  # the launcher dies at once; its workers follow (parent-death signal)
    cli.wait()
    assert marker.exists()
    proc = run_cli("train", str(config), "--run-dir", str(interrupted), "--allow-config-change")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(interrupted) == list(range(1, STEPS + 1))  # no step missing or shown twice
    whole_scalars, resumed = scalars(whole), scalars(interrupted)
    compared = [t for t in whole_scalars if not t.startswith(VOLATILE) and t != "agent/tool_time_s"]
    assert {"agent/num_turns/mean", "agent/tool_calls/mean", "critic/score/mean"} <= set(compared)
    for tag in compared:
        assert resumed[tag] == whole_scalars[tag], tag  # bitwise: the same episodes, trained on once each
