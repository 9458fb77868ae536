"""The checks a DPO run needs before anything starts.

Why apart from checks.py: DPO is offline — preference pairs in, no rollouts, no reward, no
critic — so most of the RL loop's cross-checks (group sizes, estimators, reward functions)
do not apply, and the ones that do are different (pairs per rank, the pair columns). A
config that asks DPO for a role it cannot use is refused in one line naming the field,
rather than silently ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_hpc.config.checks import DATA_SUFFIXES, check_model, check_roles
from verl_hpc.config.dpo import PAIR_COLUMNS, PREFERENCE_TASKS
from verl_hpc.config.errors import FieldError
from verl_hpc.utils.fs import expand_path

if TYPE_CHECKING:
    from verl_hpc.config.schema import RunConfig


def refuse_dpo_parts(cfg: RunConfig) -> None:
    """The RL loop scores generated answers: DPO's settings and preference tasks mean nothing to it."""
    if cfg.algorithm.dpo is not None:
        raise FieldError("algorithm.dpo", f"only read by algorithm.name: dpo (this run is {cfg.algorithm.name})",
                         "set algorithm.name: dpo, or remove algorithm.dpo")
    task = cfg.data.task
    if task is not None and task.name in PREFERENCE_TASKS:
        raise FieldError("data.task.name", f"{task.name} writes preference pairs, which only DPO trains on",
                         "set algorithm.name: dpo, or data.task.name: arithmetic")


def check_dpo(cfg: RunConfig) -> None:
    """Everything a DPO run is checked for; the model and generic role checks are checks.py's."""
    if cfg.reward is not None:
        raise FieldError("reward", "DPO learns from preference pairs and calls no reward",
                         "remove the reward section (algorithm.name: dpo)")
    _check_resources(cfg)
    _check_pairs_per_rank(cfg)
    _check_pair_data(cfg)
    check_model(cfg)
    check_roles(cfg)


def _check_resources(cfg: RunConfig) -> None:
    """Only the actor (and its frozen reference beside it) has processes: nothing is generated or scored."""
    from verl_hpc.config.resources import RoleResources

    res, algo = cfg.resources, cfg.algorithm
    if res.placement == "split":
        raise FieldError("resources.placement", "DPO generates nothing, so there are no rollouts to place apart",
                         "use resources.placement: colocated (the actor's processes run everything)")
    if res.rollout != RoleResources(device_type=res.rollout.device_type):
        raise FieldError("resources.rollout", "DPO generates nothing, so it has no rollout role",
                         "remove resources.rollout")
    for role in ("critic", "reward"):
        if res.role(role) is not None:
            raise FieldError(f"resources.{role}", f"DPO has no {role}", f"remove resources.{role}")
    ref = res.ref
    if ref is not None and (ref.device_ids != res.actor.device_ids or ref.strategy == "none"):
        raise FieldError("resources.ref", "DPO's frozen reference runs beside the actor, on its processes",
                         "remove resources.ref")
    if algo.max_staleness:
        raise FieldError("algorithm.max_staleness", "DPO is offline: there are no rollouts to run ahead",
                         "remove algorithm.max_staleness")
    if res.actor.world_size > 1 and res.actor.strategy != "fsdp":
        raise FieldError("resources.actor.strategy", f"{res.actor.world_size} actor processes share one model "
                         "only through FSDP", "set resources.actor.strategy: fsdp, or one device id")


def _check_pairs_per_rank(cfg: RunConfig) -> None:
    """`trainer.batch_size` pairs per step, one optimizer step, an equal slice per actor process."""
    algo, pairs, procs = cfg.algorithm, cfg.trainer.batch_size, cfg.resources.actor.world_size
    if algo.mini_batch_size is not None or algo.ppo_epochs != 1:
        field = "algorithm.mini_batch_size" if algo.mini_batch_size is not None else "algorithm.ppo_epochs"
        raise FieldError(field, "DPO takes one optimizer step per step, over trainer.batch_size pairs",
                         f"remove {field}")
    if pairs % procs:
        raise FieldError("resources.actor.device_ids", f"{procs} actor processes cannot split "
                         f"trainer.batch_size={pairs} preference pairs evenly",
                         f"use a process count that divides {pairs}, or a batch size that is a multiple of {procs}")
    per_rank, micro = pairs // procs, algo.micro_batch_size
    if micro is not None and micro < per_rank and per_rank % micro:
        raise FieldError("algorithm.micro_batch_size", f"each actor process's {per_rank} pairs do not split "
                         f"into micro-batches of {micro}", f"use a divisor of {per_rank}")


def _check_pair_data(cfg: RunConfig) -> None:
    """A preference task, or files with a prompt column (text or chat) and chosen/rejected text."""
    from verl_hpc.data.prompts import prompt_key_for, read_schema
    from verl_hpc.data.records import is_prompt_type, key_type

    data = cfg.data
    if data.val_files or cfg.trainer.test_freq is not None or cfg.trainer.val_before_train:
        raise FieldError("data.val_files", "validation generates answers, which DPO runs do not",
                         "remove data.val_files, trainer.test_freq and trainer.val_before_train")
    if data.task is not None and data.task.name not in PREFERENCE_TASKS:
        raise FieldError("data.task.name", f"{data.task.name} writes prompts without preference pairs",
                         f"use one of {', '.join(PREFERENCE_TASKS)}, or train_files with prompt, chosen, rejected")
    if not data.train_files and data.task is None:
        raise FieldError("data.train_files", "no preference pairs: the list is empty and data.task is not set",
                         "list Parquet/JSONL files with prompt, chosen, rejected or set data.task.name: "
                         "arithmetic_preference")
    for i, name in enumerate(data.train_files):
        path, field = expand_path(name), f"data.train_files[{i}]"
        if path.suffix not in DATA_SUFFIXES or not path.is_file():
            raise FieldError(field, f"{name} is not a readable {'/'.join(DATA_SUFFIXES)} file", "check the path")
        schema = read_schema(path)
        prompt_key = prompt_key_for(schema, data.prompt_key)
        for key, key_field in ((prompt_key, "data.prompt_key"), *((c, field) for c in PAIR_COLUMNS)):
            kind = key_type(schema, key)
            if kind is None or not is_prompt_type(kind):
                raise FieldError(key_field, f"{name} has no {key!r} column of text or chat messages "
                                 f"(has {schema.names})", "give every row prompt, chosen and rejected")
