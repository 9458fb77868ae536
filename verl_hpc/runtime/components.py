"""Build every role of the embedded runtime from a validated config.

Why separate from the loop: the loop reads as the RL algorithm (generate, score,
advantage, update); where models come from, which device they sit on and what is
skipped (no ref when KL is off, no critic for GRPO) is decided once, here.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import ConfigError, RunConfig
from verl_hpc.config.checks import expand_path, resolve_function
from verl_hpc.data.prompts import PromptDataset
from verl_hpc.data.tasks import write_task_prompts
from verl_hpc.roles.actor import Actor
from verl_hpc.roles.critic import Critic, ValueModel
from verl_hpc.roles.reward import ModelReward, RuleReward
from verl_hpc.roles.rollout import RolloutEngine, build_engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Components:
    tokenizer: Any
    device: torch.device
    dataset: PromptDataset
    prompt_ids: list[list[int]]
    actor: Actor
    rollout: RolloutEngine
    reward: Any
    ref_model: torch.nn.Module | None
    critic: Critic | None


def resolve_device(cfg: RunConfig) -> torch.device:
    actor = cfg.resources.actor
    if actor.device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("resources.actor.device_type", "cuda requested but no CUDA device is available",
                              "set device_type: cpu")
        if actor.device_ids[0] >= torch.cuda.device_count():
            raise ConfigError("resources.actor.device_ids", f"GPU {actor.device_ids[0]} does not exist "
                              f"({torch.cuda.device_count()} visible)", "use a visible device id")
        return torch.device("cuda", actor.device_ids[0])
    return torch.device("cpu")


def ensure_model(cfg: RunConfig) -> Path:
    """The model directory, built from `model.init_preset` on first use."""
    path = expand_path(cfg.model.path)
    if cfg.model.init_preset is not None:
        from verl_hpc.models.tiny import init_model

        init_model(path, preset=cfg.model.init_preset, seed=cfg.model.init_seed)
    return path


def prompt_files(cfg: RunConfig, run_dir: Path) -> list[Path]:
    files = [expand_path(f) for f in cfg.data.train_files]
    task = cfg.data.task
    if task is not None:
        out = run_dir / "data" / f"{task.name}_prompts.parquet"
        if not out.exists():
            write_task_prompts(task.name, out, task.num_prompts, task.max_operand, task.seed)
        files.append(out)
    return files


def tokenize_prompts(tokenizer, prompts: list[str], max_len: int) -> list[list[int]]:
    """Token ids per prompt, keeping the last `max_len` tokens (the question's end matters most)."""
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    return [ids[-max_len:] for ids in encoded]


def build_reward(cfg: RunConfig, tokenizer, reward_override: Any, device: torch.device):
    if reward_override is not None:
        if callable(reward_override):
            return RuleReward(reward_override, tokenizer)
        if isinstance(reward_override, str) and ":" in reward_override and not os.path.isdir(reward_override):
            return RuleReward(resolve_function(reward_override, "reward_model"), tokenizer)
        return ModelReward(str(reward_override), device)
    if cfg.reward.function is not None:
        return RuleReward(resolve_function(cfg.reward.function, "reward.function"), tokenizer)
    return ModelReward(str(expand_path(cfg.reward.model_path or "")), device)


def build_components(cfg: RunConfig, run_dir: Path, actor_model: Any = None,
                     reward_model: Any = None) -> Components:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(cfg)
    model_dir = ensure_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    dtype = DTYPES[cfg.model.dtype]
    if isinstance(actor_model, torch.nn.Module):
        model = actor_model
    else:
        source = str(actor_model) if actor_model is not None else str(model_dir)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    model.to(device)
    dataset = PromptDataset(prompt_files(cfg, run_dir), cfg.data.prompt_key, cfg.data.answer_key)
    prompt_ids = tokenize_prompts(tokenizer, dataset.prompts, cfg.data.max_prompt_length)
    algo, trainer = cfg.algorithm, cfg.trainer
    actor = Actor(model, algo, trainer.actor_optim, trainer.total_steps)
    ref_model = None
    if algo.kl.estimator != "off" and algo.kl.coef > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    critic = None
    if algo.name == "ppo":
        critic_dir = str(expand_path(cfg.model.critic_path)) if cfg.model.critic_path else str(model_dir)
        critic_model = ValueModel.from_pretrained(critic_dir, dtype).to(device)
        critic = Critic(critic_model, algo, trainer.critic_optim, trainer.total_steps)
    return Components(tokenizer=tokenizer, device=device, dataset=dataset, prompt_ids=prompt_ids, actor=actor,
                      rollout=build_engine(cfg.resources.rollout, str(model_dir), tokenizer, device, colocated=True,
                                           timeout=cfg.resources.timeout_seconds, hf_model=model,
                                           log_file=run_dir / "logs" / "vllm_engine_rank0.log", launched=False),
                      reward=build_reward(cfg, tokenizer, reward_model, device),
                      ref_model=ref_model, critic=critic)
