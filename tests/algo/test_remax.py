"""ReMax: the estimator against numbers worked out by hand; greedy baselines generated and
scored where the rows are, in one process and split; a reward group of its own refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.algo import AdvantageInputs, get_estimator
from verl_hpc.config import ConfigError, load_config
from verl_hpc.metrics import read_jsonl_metrics

G = 9.0  # garbage in padded slots: must never reach a result


def test_remax_is_the_return_to_go_minus_the_greedy_score() -> None:
    """Returns are the token rewards summed from each token to the end (KL per token included).

    row 0: rewards 0, 1 | pad   -> returns 1, 1, 0;        baseline 0.5 -> adv 0.5, 0.5, 0
    row 1: rewards -.1, 0, .6   -> returns .5, .6, .6;     baseline 1.0 -> adv -.5, -.4, -.4
    row 2: reward .3 | pad pad  -> returns .3, 0, 0;       baseline 0.0 -> adv .3, 0, 0
    """
    lengths = torch.tensor([2, 3, 1])
    mask = (torch.arange(3) < lengths[:, None]).float()
    inputs = AdvantageInputs(
        scores=torch.zeros(3), group_ids=torch.tensor([0, 1, 2]), response_mask=mask,
        token_rewards=torch.tensor([[0.0, 1.0, G], [-0.1, 0.0, 0.6], [0.3, G, G]]), values=None,
        algo=SimpleNamespace(), baselines=torch.tensor([0.5, 1.0, 0.0]))
    adv, returns = get_estimator("remax").compute(inputs)
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 0.0], [0.5, 0.6, 0.6], [0.3, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.4, -0.4], [0.3, 0.0, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="greedy responses' scores"):
        get_estimator("remax").compute(AdvantageInputs(**{**inputs.__dict__, "baselines": None}))


def remax_config(model: Path, placement: str) -> dict:
    data = quick_dict(model, steps=2)
    data["algorithm"]["adv_estimator"] = "remax"
    if placement == "split":
        data["resources"].update(placement="split", actor={"device_ids": [0, 1], "strategy": "fsdp"},
                                 rollout={"device_ids": [2]})
    return data


def test_a_reward_group_is_refused(tiny_model_dir: Path) -> None:
    data = remax_config(tiny_model_dir, "split")
    data["resources"]["reward"] = {"device_ids": [3], "strategy": "none"}
    with pytest.raises(ConfigError, match="resources.reward: the remax estimator scores each prompt's greedy"):
        load_config(data=data)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["one_process", "split"])
def test_remax_trains_with_greedy_baselines(tmp_path: Path, tiny_model_dir: Path, placement: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(remax_config(tiny_model_dir, placement)))
    proc = run_cli("train", str(path), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["actor/grad_norm"] > 0  # advantages are not all zero: samples differ from the greedy one
        assert abs(row["critic/advantages/mean"]) <= 1.0
