"""Checks of `rollout.multi_turn.environment` against the rest of the config: where its workers
run (`resources.env`) and what self-play (`players: 2`) needs of the batch and the placement."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_hpc.config.errors import FieldError

if TYPE_CHECKING:
    from verl_hpc.config.schema import RunConfig

ENV = "rollout.multi_turn.environment"


def check_environment(cfg: RunConfig) -> None:
    check_env_workers(cfg)
    check_self_play(cfg)
    check_action_wrappers(cfg)
    check_verifiers(cfg)


def check_verifiers(cfg: RunConfig) -> None:
    """A verifiers environment brings its own tools and loop: one driver (beside each rollout engine, or
    one per env-component worker) runs its episodes, so tools, worker processes on the rollout's node
    and partial rollouts are refused in one line each."""
    mt = cfg.rollout.multi_turn
    env = mt.environment
    if env is None or env.source != "verifiers" or not mt.enable:
        return
    if mt.tools or mt.tool_config_path is not None:
        raise FieldError("rollout.multi_turn.tools", "a verifiers environment serves its own tools",
                         "remove tools and tool_config_path; the environment's taskset declares its toolsets")
    if env.num_workers and cfg.resources.env is None:
        raise FieldError(f"{ENV}.num_workers", "verifiers' driver is a process of its own already; worker "
                         "processes beside it add nothing", "remove it, or place drivers on env nodes with "
                         "resources.env (one per worker)")
    if mt.partial_rollouts:
        raise FieldError("rollout.multi_turn.partial_rollouts", "a verifiers episode runs within one step's "
                         "weights (its harness holds the turns)", "set partial_rollouts: false")


def check_action_wrappers(cfg: RunConfig) -> None:
    """Action wrappers are TextArena's (their names are checked when the game is first built)."""
    env = cfg.rollout.multi_turn.environment
    if env is not None and env.action_wrappers and env.source != "textarena":
        raise FieldError(f"{ENV}.action_wrappers", f"action wrappers are TextArena's, not source {env.source!r}'s",
                         "format the action in the environment's own step(), or use source: textarena")


def check_env_workers(cfg: RunConfig) -> None:
    """`resources.env` places the environment's workers: there must be an environment, and one count."""
    workers, mt = cfg.resources.env, cfg.rollout.multi_turn
    if workers is None:
        return
    if not mt.enable or mt.environment is None:
        raise FieldError("resources.env", "environment workers are placed, but the run has no environment",
                         "set rollout.multi_turn.enable: true and rollout.multi_turn.environment, or remove "
                         "resources.env")
    if mt.environment.num_workers not in (0, workers.num_workers):
        raise FieldError(f"{ENV}.num_workers", f"{mt.environment.num_workers} differs "
                         f"from resources.env.num_workers ({workers.num_workers})",
                         "give the count in one place: resources.env.num_workers")


def check_self_play(cfg: RunConfig) -> None:
    """Self-play pairs the samples of a prompt into matches (2k: seat 0, 2k+1: seat 1) whose seats
    wait on each other's moves: a TextArena game and even sample counts (threads or workers alike)."""
    env = cfg.rollout.multi_turn.environment
    if env is None or env.players == 1 or not cfg.rollout.multi_turn.enable:
        return
    if env.source != "textarena":
        raise FieldError(f"{ENV}.players", f"self-play is built for TextArena games, not source {env.source!r}",
                         "use source: textarena (e.g. TicTacToe-v0), or players: 1")
    n = cfg.algorithm.sampling.n
    if n % 2:
        raise FieldError("algorithm.sampling.n", f"{n} samples per prompt cannot pair into two-player matches",
                         f"use an even number ({n + 1}), or {ENV}.players: 1")
    if cfg.data.val_files and cfg.trainer.val_n % 2:
        raise FieldError("trainer.val_n", f"{cfg.trainer.val_n} validation samples per prompt cannot pair into "
                         "two-player matches", f"use an even number ({cfg.trainer.val_n + 1})")
