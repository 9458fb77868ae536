"""Which paths a run reads from outside its run directory, and whether a container can see them.

Why apart from `config/container.py`: these read the whole `RunConfig` (model, data, reward,
plugins), which itself holds the container section; the section's own checks stay below the
schema, these run with the other cross-section checks (config/validate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_hpc.config.container import NO_SPACES
from verl_hpc.config.errors import FieldError

if TYPE_CHECKING:
    from verl_hpc.config.schema import RunConfig


def input_paths(cfg: RunConfig) -> list[tuple[str, str]]:
    """(field, path as written) of every file or folder the workers read that is not in the run directory."""
    found: list[tuple[str, str]] = [("model.path", cfg.model.path)]
    if cfg.model.critic_path:
        found.append(("model.critic_path", cfg.model.critic_path))
    found += [(f"data.train_files[{i}]", f) for i, f in enumerate(cfg.data.train_files)]
    found += [(f"data.val_files[{i}]", f) for i, f in enumerate(cfg.data.val_files)]
    if cfg.data.replay_rollouts:
        found.append(("data.replay_rollouts", cfg.data.replay_rollouts))
    reward = cfg.reward
    if reward is not None:
        if reward.model_path:
            found.append(("reward.model_path", reward.model_path))
        if reward.function and _is_file_spec(reward.function.rpartition(":")[0]):
            found.append(("reward.function", reward.function.rpartition(":")[0]))
        if reward.custom_reward_function is not None and reward.custom_reward_function.path:
            found.append(("reward.custom_reward_function.path", reward.custom_reward_function.path))
    found += [(f"plugins[{i}]", p.rpartition(":")[0] or p) for i, p in enumerate(cfg.plugins)
              if _is_file_spec(p.rpartition(":")[0] or p)]
    if cfg.checkpoint.resume not in ("auto", "never"):
        found.append(("checkpoint.resume", cfg.checkpoint.resume))
    return found


def _is_file_spec(text: str) -> bool:
    return "/" in text or text.endswith(".py")


def check_container_paths(cfg: RunConfig) -> None:
    """With a container, every path the workers read must be absolute (or start at ~ or $VAR).

    Why: inside the container the tasks start in the run directory, not where `verl-hpc submit`
    ran, so a relative path would name another file there; an absolute one is mounted at the
    same path and means the same file on both sides.
    """
    if cfg.slurm.container.runtime == "none":
        return
    for field, path in input_paths(cfg):
        if not path.startswith(("/", "~", "$")):
            raise FieldError(field, f"{path!r} is relative: inside the container (slurm.container) the "
                             "tasks start in the run directory", "give an absolute path")
        if not NO_SPACES.match(path) or ":" in path:
            raise FieldError(field, f"{path!r} cannot be mounted into the container (slurm.container): "
                             "mount lists are split on commas and colons", "use a path without spaces, "
                             "quotes, commas or colons")
