"""The agent role of a run, from its config: the one place the runtime builds it (any placement)."""

from __future__ import annotations

from typing import Any

from verl_hpc.roles.agent.rollout import AgentRollout, ToolRewardAdded, checked_renderer, env_runner
from verl_hpc.roles.rollout.base import stop_token_ids


def max_context(model_dir: str) -> int | None:
    """The model's positions (prompt + whole response must fit): `max_position_embeddings`."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)


def build_agent(cfg: Any, engine: Any, tokenizer: Any, model_dir: str, run_dir: str | None = None,
                allocator: Any = None, env_home: Any = None) -> Any:
    """The AgentRollout over `engine`, or a VerifiersRollout for `source: verifiers` (`allocator`: generation's OOM retries, as for single turns;
    `env_home`: where the Slurm env component's workers are, else None).

    The code sandbox takes `rollout.multi_turn.sandbox`'s limits and must never see `run_dir`.
    """
    multi_turn = cfg.rollout.multi_turn
    if multi_turn.environment is not None and multi_turn.environment.source == "verifiers":
        from verl_hpc.roles.agent.verifiers import VerifiersRollout  # its harness drives the episodes

        return VerifiersRollout(multi_turn, engine, model_dir, stop_token_ids(tokenizer, model_dir),
                                max_context(model_dir), run_dir, env_home)
    if any("sandbox" in spec for spec in multi_turn.tools) or multi_turn.tool_config_path is not None:
        from verl_hpc.roles.agent.sandbox import SandboxLimits, configure

        configure(SandboxLimits.of(multi_turn.sandbox), [str(run_dir)] if run_dir else [])
    workers = cfg.resources.env.num_workers if cfg.resources.env is not None else None
    return AgentRollout(multi_turn, engine, tokenizer, stop_token_ids(tokenizer, model_dir), max_context(model_dir),
                        allocator, env_runner(multi_turn, workers, env_home))


def check_agent(cfg: Any) -> None:
    """The tools load, the environment starts, and the model's (or the configured) chat template renders
    the tools: the checks a run would fail at start-up, done before anything starts (a model not yet
    built is skipped)."""
    from verl_hpc.roles.agent.tools import load_tools
    from verl_hpc.roles.env.preflight import check_environment
    from verl_hpc.utils.fs import expand_path

    tools = load_tools(cfg.rollout.multi_turn)
    check_environment(cfg.rollout.multi_turn)
    model_dir = expand_path(cfg.model.path)
    if (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        checked_renderer(cfg.rollout.multi_turn, AutoTokenizer.from_pretrained(str(model_dir)), tools.schemas)


def with_tool_rewards(cfg: Any, reward: Any) -> Any:
    """The reward plus the turn-level rewards tools returned, when `add_tool_rewards` asks for them:
    applied wherever the reward is built (beside the rollout, on the trainer or a reward group)."""
    multi_turn = cfg.rollout.multi_turn
    if multi_turn.enable and multi_turn.add_tool_rewards and reward is not None:
        return ToolRewardAdded(reward)
    return reward
