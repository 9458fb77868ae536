"""The checks a whole config gets once its sections are valid: across sections, files and registries.

Why registered into the schema (`CROSS_CHECKS`) rather than called from it: these checks read
the estimator registry, the data files' schemas and the model presets, so they sit above the
schema in the import order; registering here keeps every way a `RunConfig` is made (a file,
overrides, the Python facade, `Dataflow`) checked the same, with no import back up.
"""

from __future__ import annotations

from verl_hpc.config.checks import (
    check_algorithm,
    check_batches,
    check_data,
    check_model,
    check_multi_turn,
    check_reward,
    check_roles,
)
from verl_hpc.config.dpo_checks import check_dpo, refuse_dpo_parts
from verl_hpc.config.errors import FieldError
from verl_hpc.config.schema import CROSS_CHECKS, RunConfig


def cross_check(cfg: RunConfig) -> None:
    if cfg.algorithm.name == "dpo":  # offline preference pairs: no reward, no rollouts (config/dpo.py)
        check_dpo(cfg)
        return
    if cfg.reward is None:
        raise FieldError("reward", "is required but missing", "add it to the config")
    refuse_dpo_parts(cfg)
    check_algorithm(cfg)
    check_batches(cfg)
    check_model(cfg)
    check_data(cfg)
    check_reward(cfg)
    check_roles(cfg)
    check_multi_turn(cfg)


CROSS_CHECKS.append(cross_check)
