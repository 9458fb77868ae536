"""DAPO's soft overlong punishment: the pure function, the reward wrapper, the config check, a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.algo.overlong import overlong_penalty
from verl_hpc.config import ConfigError, load_config
from verl_hpc.data import RolloutBatch
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.models.tiny import build_tokenizer
from verl_hpc.roles.reward import RuleReward
from verl_hpc.roles.reward_shaping import OverlongShapedReward


def test_penalty_by_hand() -> None:
    """max_new_tokens 16, buffer 4: no penalty up to 16 - 4 = 12 tokens, then -(L - 12) / 4 * factor.

    L = 10, 12, 13, 14, 16 -> exceed -2, 0, 1, 2, 4 -> factor 1: 0, 0, -0.25, -0.5, -1;
    factor 0.5 halves them: 0, 0, -0.125, -0.25, -0.5.
    """
    lengths = torch.tensor([10, 12, 13, 14, 16])
    assert torch.allclose(overlong_penalty(lengths, 16, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]),
                          atol=1e-6)
    assert torch.allclose(overlong_penalty(lengths, 16, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]),
                          atol=1e-6)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 16, 0, 1.0)


def test_wrapper_adds_the_penalty_to_any_reward() -> None:
    """Responses of 1..4 tokens, limit 4, buffer 2: penalties 0, 0, -0.5, -1 on top of a constant 1."""
    tokenizer = build_tokenizer(64, seed=0)
    batch = RolloutBatch.from_generation([[5]] * 4, [[6] * k for k in (1, 2, 3, 4)], None, group_ids=[0, 0, 1, 1],
                                         prompt_index=[0, 0, 1, 1], ground_truth=["1"] * 4, policy_version=0)
    reward = OverlongShapedReward(RuleReward(lambda **_: 1.0, tokenizer), max_new_tokens=4, buffer_len=2,
                                  penalty_factor=1.0)
    assert reward.score(batch).tolist() == [1.0, 1.0, 0.5, 0.0]
    metrics = reward.metrics()
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.375)
    assert metrics["reward/overlong/ratio"] == 0.5
    assert metrics["reward/errors"] == 0.0  # the wrapped reward's own metrics stay


def test_buffer_longer_than_the_limit_is_refused(tiny_model_dir: Path) -> None:
    data = quick_dict(tiny_model_dir)
    data["reward"]["overlong_buffer"] = {"enable": True, "len": 99}
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len: 99 is not within 1\.\.4"):
        load_config(data=data)


@pytest.mark.slow
def test_a_run_with_the_overlong_buffer_logs_its_penalty(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = quick_dict(tiny_model_dir, steps=2)
    data["reward"]["overlong_buffer"] = {"enable": True, "len": 2, "penalty_factor": 1.0}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("train", str(path), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert all(-1.0 <= r["reward/overlong_penalty/mean"] <= 0.0 for r in rows)
    assert all(r["critic/score/min"] >= -1.0 for r in rows)
