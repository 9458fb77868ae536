"""One role builder: what a process holds, from the roles its group hosts.

Why one function for every placement: the one-process run, a colocated trainer rank, a
rollout rank and a ref/critic/reward rank differ only in *which* roles they host, never in
*how* a role is made. Building the actor, reference, critic, engine and reward in one
place is what keeps their numbers identical across placements (same weights, same value
head, same tokenisation).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.config import ConfigError, RunConfig
from verl_hpc.config.user_code import resolve_function
from verl_hpc.data.prompts import PromptDataset
from verl_hpc.data.records import RowError, fit_lengths, render_prompts
from verl_hpc.data.tasks import write_task_prompts
from verl_hpc.roles.actor import Actor
from verl_hpc.roles.allocator import ResourceAllocator
from verl_hpc.roles.critic import Critic, ValueModel
from verl_hpc.roles.fsdp import checkpoint_activations
from verl_hpc.roles.loading import GroupLoad, causal_lm_skeleton
from verl_hpc.roles.lora import apply_lora
from verl_hpc.roles.offload import ParamOffload, offloads_to_host
from verl_hpc.roles.precision import shard_or_autocast
from verl_hpc.roles.reward import ModelReward, RuleReward
from verl_hpc.roles.reward_shaping import OverlongShapedReward
from verl_hpc.roles.rollout import RolloutEngine, build_engine
from verl_hpc.utils.fs import expand_path
from verl_hpc.utils.logging import get_logger

log = get_logger("build")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Roles:
    """What one process holds; a role it does not host is None."""

    tokenizer: Any
    device: torch.device
    dataset: PromptDataset
    prompt_ids: list[list[int]]
    hosted: tuple[str, ...]
    val_dataset: PromptDataset | None = None       # data.val_files, on processes that validate
    val_prompt_ids: list[list[int]] | None = None
    actor: Actor | None = None
    ref_model: torch.nn.Module | None = None
    ref_offload: ParamOffload = field(default_factory=ParamOffload.none)  # model.param_offload.ref
    critic: Critic | None = None
    engine: RolloutEngine | None = None
    reward: Any = None                             # RuleReward, ModelReward or JudgeReward (roles/)
    allocator: ResourceAllocator = field(default_factory=ResourceAllocator)  # generation's OOM retries
    agent: Any = None  # AgentRollout (roles/agent) when rollout.multi_turn.enable: rows are episodes

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.engine is not None:
            self.engine.close()
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()  # a rule reward's pool processes, if any


@dataclass
class BuildSpec:
    """Where this process's roles live: its group's roles, device, and FSDP group if sharded."""

    hosted: tuple[str, ...]
    device: torch.device
    fsdp_group: dist.ProcessGroup | None = None   # the group's process group when it shards (FSDP2)
    engine_colocated: bool = True                 # the engine time-shares the trainer's devices
    engine_log: Path | None = None
    launched: bool = True                         # devices already narrowed by a launcher/Slurm
    rollout_builds_reward: bool = True            # a rule reward scores where rollouts are made


def resolve_device(cfg: RunConfig) -> torch.device:
    """The device of a one-process run (the actor's first device)."""
    actor = cfg.resources.actor
    if actor.device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("resources.actor.device_type", "cuda requested but no CUDA device is available",
                              "set device_type: cpu (or resources.device_type=cpu for every role)")
        if actor.device_ids[0] >= torch.cuda.device_count():
            raise ConfigError("resources.actor.device_ids", f"GPU {actor.device_ids[0]} does not exist "
                              f"({torch.cuda.device_count()} visible)", "use a visible device id")
        return torch.device("cuda", actor.device_ids[0])
    return torch.device("cpu")


def ensure_model(cfg: RunConfig) -> Path:
    """The model directory; `model.init_preset` builds a random-weight one there only where the path is new.

    Why only there, and never quietly: a preset asks for a random model, so building over a
    directory that holds one, or at a path one typo away from a model, would train noise
    under a real model's name. A path that holds a model is used as it is; a new one is
    built in, saying so in one line; a new one that looks like a typo of a model beside it
    is refused, naming both.
    """
    path = expand_path(cfg.model.path)
    preset, seed = cfg.model.init_preset, cfg.model.init_seed
    if preset is None:
        return path
    from verl_hpc.models.tiny import init_model, is_built

    if is_built(path):
        try:
            return init_model(path, preset=preset, seed=seed)  # the same preset and seed: reused as it is
        except FileExistsError as err:
            raise ConfigError("model.init_preset", str(err).split(";")[0], "set model.init_preset and init_seed "
                              "to what it was built with, or choose a new model.path") from None
    if (path / "config.json").is_file():
        return path  # the user's own model: nothing to build
    if path.exists() and any(path.iterdir()):
        raise ConfigError("model.path", f"{path} holds no model (no config.json) and is not empty",
                          "point model.path at a model directory, or at a new one for model.init_preset to build in")
    near = near_model(path)
    if near is not None:
        raise ConfigError("model.path", f"{path} does not exist, but {near} beside it holds a model",
                          f"fix model.path if you meant {near.name}; model.init_preset would build a random "
                          "model at the new path")
    log.warning("model.path %s does not exist: building a random-weight %s model there (model.init_preset: %s, "
                "init_seed: %d)", path, preset, preset, seed)
    return init_model(path, preset=preset, seed=seed)


def near_model(path: Path, cutoff: float = 0.85) -> Path | None:
    """A sibling directory whose name is almost `path`'s and that holds a model not built from a preset."""
    import difflib

    from verl_hpc.models.tiny import is_built

    try:
        siblings = [p for p in path.parent.iterdir() if p.is_dir() and p.name != path.name]
    except OSError:
        return None
    names = {p.name.lower(): p for p in siblings if (p / "config.json").is_file() and not is_built(p)}
    close = difflib.get_close_matches(path.name.lower(), list(names), n=1, cutoff=cutoff)
    return names[close[0]] if close else None


def prompt_files(cfg: RunConfig, run_dir: Path) -> list[Path]:
    files = [expand_path(f) for f in cfg.data.train_files]
    task = cfg.data.task
    if task is not None:
        out = run_dir / "data" / f"{task.name}_prompts.parquet"
        if not out.exists():
            write_task_prompts(task.name, out, task.num_prompts, task.max_operand, task.seed)
        files.append(out)
    gym = cfg.data.reasoning_gym
    if gym is not None:
        from verl_hpc.data.tasks import reasoning_gym

        out = run_dir / "data" / "reasoning_gym_prompts.jsonl"
        if not out.exists():  # written once: a resumed run trains on the same prompts
            reasoning_gym.write_prompts(out, [(t.name, t.weight, t.config) for t in gym.entries()], gym.size,
                                        gym.seed, gym.system_prompt, gym.chat)
        files.append(out)
    return files


def tokenize_prompts(tokenizer, prompts: list[Any], max_len: int, truncation: str = "error",
                     where: list[str] | None = None) -> list[list[int]]:
    """Token ids per prompt: text as is, chat messages through the chat template, fit per `truncation`.

    Why `error` by default (verl's): cutting a chat prompt silently drops its template's
    leading tokens (93 of 200 SmolLM2 prompts lost them under the old left-cut).
    """
    where = where if where is not None else [f"prompt {i}" for i in range(len(prompts))]
    try:
        texts = render_prompts(tokenizer, prompts, where, "data.prompt_key")
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return fit_lengths(encoded, max_len, truncation, where, "data.max_prompt_length")
    except RowError as err:
        raise ConfigError(err.field, err.message, err.hint) from None


def load_dataset(cfg: RunConfig, run_dir: Path, tokenizer,
                 files: list[Path] | None = None) -> tuple[PromptDataset, list[list[int]]]:
    """The prompts (`files`, default the training set), every row checked and tokenized before any
    generation, over-long ones dropped if asked."""
    data = cfg.data
    try:
        dataset = PromptDataset(files if files is not None else prompt_files(cfg, run_dir), data.prompt_key, data.answer_key, data.reward_fn_key,
                                data.extra_info_key, require_answer=cfg.reward.function_spec is not None)
    except RowError as err:
        raise ConfigError(err.field, err.message, err.hint) from None
    truncation = "left" if data.filter_overlong_prompts else data.truncation  # nothing over is left to cut
    ids = tokenize_prompts(tokenizer, dataset.prompts, 10**9 if data.filter_overlong_prompts else
                           data.max_prompt_length, truncation, dataset.where)
    if data.filter_overlong_prompts:
        keep = [i for i, row in enumerate(ids) if len(row) <= data.max_prompt_length]
        if not keep:
            raise ConfigError("data.filter_overlong_prompts", f"every one of the {len(ids)} prompts is longer "
                              f"than data.max_prompt_length={data.max_prompt_length}", "raise max_prompt_length")
        dataset.keep(keep)
        ids = [ids[i] for i in keep]
    return dataset, ids


def build_reward(cfg: RunConfig, tokenizer, device: torch.device, override: Any = None) -> Any:
    """The rule function or reward model (`override`: the facade's `reward_model=` object),
    with DAPO's overlong penalty on top when `reward.overlong_buffer.enable`."""
    from verl_hpc.roles.agent.build import with_tool_rewards

    base = with_tool_rewards(cfg, _base_reward(cfg, tokenizer, device, override))
    overlong = cfg.reward.overlong_buffer
    if not overlong.enable:
        return base
    return OverlongShapedReward(base, cfg.algorithm.sampling.max_new_tokens, overlong.len, overlong.penalty_factor)


def _base_reward(cfg: RunConfig, tokenizer, device: torch.device, override: Any = None) -> Any:
    reward = cfg.reward
    on_error = reward.on_error
    if override is not None:
        if callable(override):
            return RuleReward(override, tokenizer, on_error=on_error)
        if isinstance(override, str) and ":" in override and not os.path.isdir(override):
            return RuleReward(resolve_function(override, "reward_model"), tokenizer, on_error=on_error)
        return ModelReward(str(override), device, on_error=on_error)
    spec = reward.function_spec
    rule = None
    if spec is not None:
        custom = reward.custom_reward_function
        rule = RuleReward(resolve_function(spec, reward.function_field), tokenizer, on_error=on_error, spec=spec,
                          field=reward.function_field, num_workers=reward.num_workers,
                          timeout=reward.timeout_seconds, reward_kwargs=custom.reward_kwargs if custom else None)
    if reward.judge is not None:
        from verl_hpc.roles.judge import JudgeReward

        return JudgeReward(reward.judge, tokenizer, device, on_error=on_error, combine=rule,
                           timeout=cfg.resources.timeout_seconds)
    if rule is not None:
        return rule
    return ModelReward(str(expand_path(reward.model_path or "")), device, on_error=on_error)


def load_causal_lm(path: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def env_home(cfg: RunConfig, run_dir: Path) -> Any:  # -> EnvHome | None
    """Where the env component's workers are (under Slurm with `resources.env`), else None: the
    rollout starts its environment workers itself."""
    from verl_hpc.runtime.process.env import JobEnvironment

    if cfg.resources.env is None or JobEnvironment.from_env().scheduler != "slurm":
        return None
    from verl_hpc.roles.env.remote import EnvHome
    from verl_hpc.transport.secret import read_run_secret

    return EnvHome.of_attempt(run_dir, cfg.resources.env.num_workers, read_run_secret(run_dir),
                              cfg.resources.timeout_seconds)


def build_roles(cfg: RunConfig, run_dir: Path, spec: BuildSpec, actor_model: Any = None,
                reward_model: Any = None) -> Roles:
    """Every role `spec.hosted` names, on `spec.device`, sharded over `spec.fsdp_group` if set."""
    from transformers import AutoTokenizer

    model_dir = str(ensure_model(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    dataset, prompt_ids = load_dataset(cfg, run_dir, tokenizer)
    roles = Roles(tokenizer=tokenizer, device=spec.device, dataset=dataset, hosted=spec.hosted,
                  prompt_ids=prompt_ids)
    dtype = DTYPES[cfg.model.dtype]
    load = GroupLoad(spec.fsdp_group, spec.device, cfg.model.load if actor_model is None else "every_rank")
    policy = None
    if "actor" in spec.hosted or "ref" in spec.hosted:
        policy = actor_model if isinstance(actor_model, torch.nn.Module) else \
            causal_lm_skeleton(model_dir, dtype) if load.skeleton else \
            load_causal_lm(str(actor_model) if actor_model is not None else model_dir, dtype)
        if not load.skeleton:  # a skeleton gets its storage, on the device, once sharded
            policy.to(spec.device)
    if "ref" in spec.hosted:
        offload = cfg.model.param_offload.ref
        roles.ref_model = _frozen(copy.deepcopy(policy), cfg, spec, load, offload)
        roles.ref_offload = ParamOffload(roles.ref_model, spec.device, offload, name="ref")
    if "actor" in spec.hosted:
        if cfg.model.lora is not None:  # after the ref's copy: the ref is the base model
            apply_lora(policy, cfg.model.lora, cfg.trainer.seed)
        if cfg.model.gradient_checkpointing:  # after the ref's copy: a frozen ref never trains
            checkpoint_activations(policy)
        load.shard(policy, lambda m: shard_or_autocast(m, cfg.model.mixed_precision, spec.device, spec.fsdp_group))
        roles.actor = Actor(policy, cfg.algorithm, cfg.trainer.actor_optim, cfg.trainer.total_steps,
                            dp_group=spec.fsdp_group, chunk_tokens=cfg.model.logprob_chunk_tokens,
                            remove_padding=cfg.model.remove_padding)
    if "critic" in spec.hosted:
        roles.critic = _build_critic(cfg, spec, model_dir, dtype, load)
    roles.allocator = ResourceAllocator(spec.device, cfg.trainer.min_micro_batch_size, cfg.trainer.oom_retry)
    if "rollout" in spec.hosted:
        roles.engine = _build_engine(cfg, spec, roles, model_dir, policy)
        rule_only = cfg.reward.function_spec is not None and not cfg.reward.is_model
        if (spec.rollout_builds_reward and rule_only) or callable(reward_model):
            roles.reward = build_reward(cfg, tokenizer, spec.device, reward_model)
        if cfg.rollout.multi_turn.enable:
            from verl_hpc.roles.agent.build import build_agent

            roles.agent = build_agent(cfg, roles.engine, tokenizer, model_dir, str(run_dir), roles.allocator,
                                      env_home(cfg, run_dir))
    if "reward" in spec.hosted and roles.reward is None:
        roles.reward = build_reward(cfg, tokenizer, spec.device, reward_model)
    if cfg.data.val_files and ("actor" in spec.hosted or "rollout" in spec.hosted):  # generating, or counting rows
        roles.val_dataset, roles.val_prompt_ids = load_dataset(
            cfg, run_dir, tokenizer, [expand_path(f) for f in cfg.data.val_files])
    trainer = cfg.trainer
    if roles.actor is not None and spec.fsdp_group is None:
        roles.actor.allocator = roles.allocator  # a lone trainer: one allocator, logged and checkpointed
    elif roles.actor is not None:  # training retries only on a lone trainer: an FSDP peer would hang waiting
        roles.actor.allocator = ResourceAllocator(spec.device, trainer.min_micro_batch_size, False)
    return roles


def _frozen(model: torch.nn.Module, cfg: RunConfig, spec: BuildSpec, load: GroupLoad,
            offload: bool = False) -> torch.nn.Module:
    model.eval().requires_grad_(False)
    return load.shard(model, lambda m: shard_or_autocast(m, cfg.model.mixed_precision, spec.device, spec.fsdp_group,
                                                         offload), offloads_to_host(offload, spec.device))


def _build_critic(cfg: RunConfig, spec: BuildSpec, model_dir: str, dtype: torch.dtype, load: GroupLoad) -> Critic:
    critic_dir = str(expand_path(cfg.model.critic_path)) if cfg.model.critic_path else model_dir
    value_model = ValueModel.from_pretrained(critic_dir, dtype, seed=cfg.trainer.seed, skeleton=load.skeleton)
    value_model.remove_padding = cfg.model.remove_padding
    if not load.skeleton:
        value_model.to(spec.device)
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(value_model)
    offload = cfg.model.param_offload.critic
    load.shard(value_model, lambda m: shard_or_autocast(m, cfg.model.mixed_precision, spec.device, spec.fsdp_group,
                                                        offload), offloads_to_host(offload, spec.device))
    return Critic(value_model, cfg.algorithm, cfg.trainer.critic_optim, cfg.trainer.total_steps,
                  dp_group=spec.fsdp_group, offload=ParamOffload(value_model, spec.device, offload, name="critic"))


def _build_engine(cfg: RunConfig, spec: BuildSpec, roles: Roles, model_dir: str,
                  policy: torch.nn.Module | None) -> RolloutEngine:
    """The rollout engine; a lone unsharded actor shares its module with an HF engine (no copy, no sync)."""
    resources = cfg.resources.rollout
    hf_model = None
    if resources.strategy != "vllm":
        shareable = policy is not None and spec.fsdp_group is None and roles.actor is not None
        hf_model = policy if shareable else load_causal_lm(model_dir, DTYPES[cfg.model.dtype]).to(spec.device)
    engine = build_engine(resources, model_dir, roles.tokenizer, spec.device, colocated=spec.engine_colocated,
                          timeout=cfg.resources.timeout_seconds, hf_model=hf_model, log_file=spec.engine_log,
                          launched=spec.launched)
    if cfg.data.replay_rollouts is not None:
        from verl_hpc.roles.rollout.replay import ReplayRolloutEngine

        engine = ReplayRolloutEngine(engine, expand_path(cfg.data.replay_rollouts))
    return engine
