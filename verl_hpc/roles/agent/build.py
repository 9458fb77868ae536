"""The agent role of a run, from its config: the one place the runtime builds it (any placement)."""

from __future__ import annotations

from typing import Any

from verl_hpc.roles.agent.rollout import AgentRollout, ToolRewardAdded
from verl_hpc.roles.rollout.base import stop_token_ids


def max_context(model_dir: str) -> int | None:
    """The model's positions (prompt + whole response must fit): `max_position_embeddings`."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)


def build_agent(cfg: Any, engine: Any, tokenizer: Any, model_dir: str, reward: Any,
                run_dir: str | None = None) -> tuple[AgentRollout, Any]:
    """(the AgentRollout over `engine`, the reward — with the tools' rewards added when asked).

    The code sandbox takes `rollout.multi_turn.sandbox`'s limits and must never see `run_dir`.
    """
    multi_turn = cfg.rollout.multi_turn
    if any("sandbox" in spec for spec in multi_turn.tools) or multi_turn.tool_config_path is not None:
        from verl_hpc.roles.agent.sandbox import SandboxLimits, configure

        configure(SandboxLimits.of(multi_turn.sandbox), [str(run_dir)] if run_dir else [])
    agent = AgentRollout(multi_turn, engine, tokenizer, stop_token_ids(tokenizer, model_dir), max_context(model_dir))
    if multi_turn.add_tool_rewards and reward is not None:
        reward = ToolRewardAdded(reward)
    return agent, reward
