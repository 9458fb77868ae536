"""Every preset learns: in one process, and through the CLI in split placement
(the rollout in a process of its own, where DAPO's generation rounds and ReMax's greedy
baselines run, and the KL in the reward crosses processes).

The quickstart model on the arithmetic prompts, with a reward it can learn in a few steps
(the share of 1s in the response: ~0.01 for the untrained model, whose groups of 8 still
differ, so DAPO's dynamic sampling keeps most of them). Eight steps at lr 0.01 unless
`STEPS`/`LR` say otherwise; the score of the last two steps must be well above the
untrained policy's. DPO trains offline on preference pairs: tests/runtime/test_dpo.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.config import load_config
from verl_hpc.config.presets import PRESETS
from verl_hpc.launch.train import train
from verl_hpc.metrics import read_jsonl_metrics

ONLINE = sorted(name for name in PRESETS if name != "dpo")
SPLIT = {"placement": "split", "actor": {"device_ids": [0], "strategy": "hf"}, "rollout": {"device_ids": [1]}}
# Slower learners get more: ReMax's advantages (reward minus the greedy reward) are not scaled
# by a group's spread, so a larger step (PPO at 0.03 collapses instead); PPO's critic starts
# untrained, so more steps: its score passed 0.15 after 8 steps in one process and after 14
# in split placement, whose rollout process samples with a generator of its own.
LR = {"remax": 0.03}
STEPS = {"ppo": 20}


def ones(prompt: str, response: str, **_: object) -> float:
    """The share of the response's characters that are the digit 1."""
    return response.count("1") / max(len(response), 1)


def _config(model: Path, name: str) -> dict:
    data = quick_dict(model, steps=STEPS.get(name, 8))
    data["trainer"].update(batch_size=64, save_hf_model=False, actor_optim={"lr": LR.get(name, 0.01)})
    data["reward"] = {"function": f"{Path(__file__).resolve()}:ones"}
    data["algorithm"]["name"] = name
    data["logging"]["sample_every"] = 1000
    return data


def _assert_learned(run_dir: Path) -> None:
    score = [r["critic/score/mean"] for r in read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")]
    first, last = score[0], sum(score[-2:]) / 2
    assert last >= 0.15 and last > first + 0.1, " ".join(f"{x:.3f}" for x in score)


@pytest.mark.slow
@pytest.mark.parametrize("name", ONLINE)
def test_every_preset_learns_in_one_process(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    """`verl-hpc train`'s own entry point, in this process (the CLI adds argument parsing only)."""
    result = train(load_config(data=_config(tiny_model_dir, name)), tmp_path / "run")
    _assert_learned(result.run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", ONLINE)
def test_presets_learn_in_split_placement_through_the_cli(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    data = _config(tiny_model_dir, name)
    data["resources"].update(SPLIT)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("train", str(path), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_learned(tmp_path / "run")
