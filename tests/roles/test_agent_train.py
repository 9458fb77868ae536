"""Multi-turn runs through `verl-hpc train`'s one-process path: they finish, count, refuse bad tools, learn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from verl_hpc.config import ConfigError
from verl_hpc.config.loader import load_config
from verl_hpc.launch.train import train

FLAKY = f"{REPO / 'tests' / 'plugins' / 'agent_flaky.py'}:peek"


def agent_config(model_dir: Path) -> dict:
    cfg = {"model": {"path": str(model_dir), "init_preset": "tiny-agent"},
           "data": {"task": {"name": "hidden_digit", "num_prompts": 64, "seed": 0}},
           "reward": {"function": "verl_hpc.data.tasks.hidden_digit:score"},
           "rollout": {"multi_turn": {"enable": True, "tools": ["verl_hpc.data.tasks.hidden_digit:peek"],
                                      "max_assistant_turns": 2, "max_tool_response_length": 100}},
           "algorithm": {"name": "grpo", "sampling": {"n": 4, "max_new_tokens": 6}, "kl": {"coef": 0.0}},
           "trainer": {"total_steps": 2, "batch_size": 16, "save_hf_model": False},
           "checkpoint": {"interval_steps": 100}, "logging": {"sinks": []}}
    return cfg


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]


def forced_caller(model_dir: Path) -> torch.nn.Module:
    """The tiny-agent policy with a head that always calls the tool: every episode reaches its tools."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    call = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(
        '<tool_call>{"name": "peek", "arguments": {}}</tool_call>')
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-20.0)
        head.bias[call] = 20.0
    model.lm_head = head
    return model


@pytest.mark.slow
def test_failing_tools_cost_a_call_and_the_run_finishes(tmp_path) -> None:
    from verl_hpc.models.tiny import init_model

    model_dir = init_model(tmp_path / "tiny-agent", preset="tiny-agent")
    raw = agent_config(model_dir)
    raw["rollout"]["multi_turn"].update(tools=[FLAKY], tool_timeout_seconds=0.5)
    cfg = load_config(data=raw)
    result = train(cfg, tmp_path / "run", actor_model=forced_caller(model_dir))
    assert result.steps == 2
    rows = read_metrics(tmp_path / "run")
    errors = sum(r["agent/tool_errors"] for r in rows)
    assert errors > 0 and all(r["agent/num_turns/mean"] == 2.0 for r in rows)
    assert all(r["agent/template_mismatch"] == 0 for r in rows)
    assert all(r["response_length/max"] <= 6 for r in rows)  # the model's tokens: tool replies do not count


def test_a_bad_tool_is_refused_before_the_run_starts(tmp_path) -> None:
    raw = agent_config(tmp_path / "model")
    raw["rollout"]["multi_turn"]["tools"] = [f"{REPO / 'tests' / 'plugins' / 'agent_tools.py'}:no_doc"]
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.tools\[0\]: .*no_doc has no docstring"):
        train(load_config(data=raw), tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()
