"""The agent role of a run, from its config: the one place the runtime builds it (any placement)."""

from __future__ import annotations

from typing import Any

from verl_hpc.roles.agent.rollout import AgentRollout, ToolRewardAdded
from verl_hpc.roles.rollout.base import stop_token_ids


def max_context(model_dir: str) -> int | None:
    """The model's positions (prompt + whole response must fit): `max_position_embeddings`."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)


def build_agent(cfg: Any, engine: Any, tokenizer: Any, model_dir: str, reward: Any) -> tuple[AgentRollout, Any]:
    """(the AgentRollout over `engine`, the reward — with the tools' rewards added when asked)."""
    multi_turn = cfg.rollout.multi_turn
    agent = AgentRollout(multi_turn, engine, tokenizer, stop_token_ids(tokenizer, model_dir), max_context(model_dir))
    if multi_turn.add_tool_rewards and reward is not None:
        reward = ToolRewardAdded(reward)
    return agent, reward
