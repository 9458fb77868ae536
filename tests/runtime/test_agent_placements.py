"""Agent episodes in every placement: recorded multi-turn rollouts replay to the same numbers.

One one-process run samples episodes of the built-in tool task (tool replies inserted into the
responses, masked out of the loss) and records them; every placement then replays the whole
trajectories — ids, loss masks, turns and the episode records the reward reads — so what is
left (scores from the records, reference and old logprobs, masked advantages and losses,
optimizer steps) must agree as it does for single-turn rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.runtime.test_placement_equivalence import COMMON_KEYS, PLACEMENTS, replay_everywhere, rows
from verl_hpc.data.rollout_batch import RolloutBatch

pytestmark = pytest.mark.slow
AGENT_KEYS = ("agent/num_turns/mean", "agent/num_turns/max", "agent/tool_calls/mean", "agent/truncated_ratio",
              "response_length/mean")
REWARD_GROUP = {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "rollout": {"device_ids": [2]},
                "reward": {"device_ids": [3], "strategy": "none"}, "placement": "split"}


def agent_config(model_dir: Path, steps: int) -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir), "init_preset": "tiny-agent"},
        "data": {"task": {"name": "hidden_digit", "num_prompts": 64, "max_operand": 3, "seed": 0}},
        "reward": {"function": "verl_hpc.data.tasks.hidden_digit:score"},
        "rollout": {"multi_turn": {"enable": True, "tools": ["verl_hpc.data.tasks.hidden_digit:peek"],
                                   "max_assistant_turns": 2, "max_tool_response_length": 16}},
        "algorithm": {"name": "grpo", "sampling": {"n": 4, "max_new_tokens": 6},
                      "kl": {"estimator": "k3", "coef": 0.1}, "ppo_epochs": 2, "mini_batch_size": 8},
        "trainer": {"total_steps": steps, "batch_size": 16, "seed": 0, "torch_threads": 1,
                    "actor_optim": {"lr": 1e-3, "eps": 1e-3}},  # eps: see test_placement_equivalence
        "resources": {"actor": {"device_ids": [0]}, "placement": "colocated", "timeout_seconds": 120},
        "logging": {"progress": "off", "num_samples": 0},
    }


def test_recorded_multi_turn_rollouts_agree_on_every_placement(tmp_path: Path) -> None:
    from verl_hpc.models.tiny import init_model

    model_dir = init_model(tmp_path / "tiny-agent", preset="tiny-agent", seed=0)
    placements = {**PLACEMENTS, "split, rule reward on its own": REWARD_GROUP}
    replay_everywhere(tmp_path, agent_config(model_dir, steps=3), COMMON_KEYS + AGENT_KEYS, placements)
    recorded = [RolloutBatch.from_ipc(p.read_bytes()) for p in sorted((tmp_path / "recorded" / "rollouts").iterdir())]
    assert all(b.is_trajectory for b in recorded)
    inserted = sum(int((b.loss_mask() == 0).sum()) - int((b.loss_mask().shape[1] - b.response_lengths()).sum())
                   for b in recorded)
    assert inserted > 0  # some episodes called the tool: its reply sits in the scored ids, masked out
    for name in ("one_process", "split_2_+_1", "split_rule_reward_on_its_own"):
        assert all(r["agent/num_turns/max"] >= 1 for r in rows(tmp_path / name)), name
