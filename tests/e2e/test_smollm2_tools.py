"""SmolLM2-135M-Instruct with a calculator tool: its own template is refused, the hermes one trains.

SmolLM2's chat template is plain ChatML: it ignores `tools=`, so the model would never see the
tool. The run refuses it in one line before anything starts, and trains 3 multi-turn GRPO steps
once the config names a tool-capable template (configs/hermes_chatml.jinja).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import REPO, load_module, run_cli

pytestmark = pytest.mark.slow
CONFIG = str(REPO / "configs" / "smollm2_gsm8k_tools.yaml")


def model_and_data(tmp_path: Path) -> tuple[Path, Path]:
    model_dir = load_module(REPO / "tools" / "make_smollm2.py").build()
    data = load_module(REPO / "examples" / "gsm8k" / "make_data.py").write(tmp_path / "gsm8k", count=4)
    return model_dir, data


def test_smollm2s_own_template_is_refused_in_one_line(tmp_path: Path) -> None:
    model_dir, data = model_and_data(tmp_path)
    proc = run_cli("train", CONFIG, "--run-dir", str(tmp_path / "run"), f"model.path={model_dir}",
                   f"data.train_files=[{data}]", "rollout.multi_turn.chat_template=null")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "rollout.multi_turn.chat_template: the tokenizer's chat template ignores tools=" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_smollm2_with_a_calculator_tool_trains_three_steps(tmp_path: Path) -> None:
    model_dir, data = model_and_data(tmp_path)
    run_dir = tmp_path / "run"
    proc = run_cli("train", CONFIG, "--run-dir", str(run_dir), f"model.path={model_dir}",
                   f"data.train_files=[{data}]", "algorithm.sampling.max_new_tokens=24", timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for step in metrics:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "agent/num_turns/mean",
                    "agent/tool_calls/mean", "training/rollout_probs_diff_max"):
            assert math.isfinite(step[key]), (key, step)
        assert step["response_length/max"] <= 24  # the model's own tokens: tool replies do not count
    log = (run_dir / "logs" / "trainer_rank0.log").read_text() if (run_dir / "logs").exists() else proc.stderr
    assert "configs/hermes_chatml.jinja" in log  # the run says which template it used
